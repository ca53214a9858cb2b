use std::any::TypeId;
use std::error::Error as StdError;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

pub use crate::error::BoxError;
use crate::error::BrokerError;

/// What a failure means for retrying.
///
/// Failure classes, and how an error is classified: by its **type**, walking the
/// `source()` chain, never by its message text.
///
/// A handler returns any error (`Box<dyn Error>`, so `?` works on everything). The
/// [`Classifier`] looks at the error and each of its sources, outermost first, and the
/// first one it recognises decides:
///
/// 1. reliq's markers — [`Transient`], [`Permanent`], [`Poison`] — which a handler wraps
///    around an error to say what it means;
/// 2. rules registered for your own error types with [`Classifier::on`];
/// 3. built-in rules: reliq's [`DecodeError`], `serde_json::Error`, UTF-8 errors → poison;
///    `tokio::time::error::Elapsed` and I/O errors that mean "try again" (timeouts,
///    resets, refused connections) → transient.
///
/// Anything else is [`ErrorClass::Unknown`]: it gets the policy's small unknown-error
/// budget, then parks as `exhausted`.
///
/// ```
/// use reliq_core::{Classifier, ErrorClass, Permanent};
/// #[derive(Debug, thiserror::Error)]
/// #[error("deadlock detected")]
/// struct Deadlock;
///
/// let classifier = Classifier::default().on::<Deadlock>(|_| ErrorClass::Transient);
/// let err: reliq_core::BoxError = Box::new(Deadlock);
/// assert_eq!(classifier.classify(err.as_ref()), ErrorClass::Transient);
/// let err: reliq_core::BoxError = Box::new(Permanent::msg("sku does not exist"));
/// assert_eq!(classifier.classify(err.as_ref()), ErrorClass::Permanent);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// A retry may help (timeout, 5xx, 429, deadlock, connection reset).
    Transient,
    /// A retry cannot help (validation, 4xx, state conflict): dead-letter at once.
    Permanent,
    /// The message cannot even be decoded: dead-letter at once.
    Poison,
    /// The handler panicked.
    Panic,
    /// Nothing recognised the error: a small bounded retry budget, then park.
    Unknown,
}

impl ErrorClass {
    /// Every class, for metrics pre-registration.
    pub const ALL: [ErrorClass; 5] = [
        Self::Transient,
        Self::Permanent,
        Self::Poison,
        Self::Panic,
        Self::Unknown,
    ];

    /// The header/metric label spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Transient => "transient",
            Self::Permanent => "permanent",
            Self::Poison => "poison",
            Self::Panic => "panic",
            Self::Unknown => "unknown",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text was not a known class name.
#[derive(Debug, thiserror::Error)]
#[error("unknown error class `{0}`")]
pub struct UnknownClass(String);

impl FromStr for ErrorClass {
    type Err = UnknownClass;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownClass(s.to_owned()))
    }
}

macro_rules! marker {
    ($(#[$doc:meta])* $name:ident, $class:expr) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name(BoxError);

        impl $name {
            /// Wrap an error.
            pub fn new(error: impl Into<BoxError>) -> Self {
                Self(error.into())
            }

            /// A marker with just a message.
            pub fn msg(message: impl fmt::Display) -> Self {
                Self(message.to_string().into())
            }

            /// The class this marker stands for.
            pub const CLASS: ErrorClass = $class;
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl StdError for $name {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(self.0.as_ref())
            }
        }
    };
}

marker!(
    /// Marks an error as transient: retrying later may succeed.
    Transient,
    ErrorClass::Transient
);
marker!(
    /// Marks an error as permanent: retrying cannot help; dead-letter at once.
    Permanent,
    ErrorClass::Permanent
);
marker!(
    /// Marks a message as poison: it cannot be decoded; dead-letter at once.
    Poison,
    ErrorClass::Poison
);

/// A payload could not be decoded (bad JSON, invalid UTF-8, unknown schema version,
/// missing id). Always classified as [`ErrorClass::Poison`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload is not valid JSON for the expected type.
    #[error("payload is not valid JSON for the expected type: {0}")]
    Json(#[from] serde_json::Error),
    /// The payload is not UTF-8.
    #[error("payload is not valid UTF-8: {0}")]
    Utf8(#[from] std::str::Utf8Error),
    /// The envelope's major schema version is not one this consumer understands.
    #[error("unsupported schema version `{found}` (this consumer understands major {supported})")]
    SchemaVersion {
        /// The version found.
        found: String,
        /// The major version supported.
        supported: u32,
    },
    /// The payload is not valid `format` for the expected type (Avro, Protobuf, the
    /// schema-registry framing); `reason` is the decoder's, naming the field where it can.
    #[error("payload is not valid {format} for the expected type: {reason}")]
    Format {
        /// The wire format.
        format: &'static str,
        /// What the decoder said.
        reason: String,
    },
    /// A required field is missing or empty.
    #[error("required field `{0}` is missing or empty")]
    Missing(&'static str),
}

/// A codec failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The payload is not a value of the expected type: poison, parked with this reason.
    #[error(transparent)]
    Undecodable(#[from] DecodeError),
    /// The value cannot be encoded (it does not fit the schema, or the registry refused
    /// the schema as incompatible): permanent, another try is refused the same way.
    #[error("cannot encode the message: {0}")]
    Unencodable(String),
    /// A service the codec needs did not answer (the schema registry): transient.
    #[error("{context}")]
    Unavailable {
        /// What was being done.
        context: String,
        /// The client's error.
        #[source]
        source: Option<BoxError>,
    },
}

impl CodecError {
    /// [`CodecError::Undecodable`] from a decoder's message: `format` names the wire format
    /// (`Avro`, `Protobuf`, `schema-registry framing`), `reason` is the decoder's text.
    pub fn undecodable(format: &'static str, reason: impl std::fmt::Display) -> Self {
        Self::Undecodable(DecodeError::Format {
            format,
            reason: reason.to_string(),
        })
    }
}

/// An error and its `source()` chain, displayed `outer: inner: innermost` (a link whose
/// text the outer ones already contain is left out). For logs: an error that keeps its
/// client error as its source says what was being done in its own text and what the
/// client said in the source.
///
/// ```
/// use reliq_core::{BrokerError, ErrorChain};
/// let e = BrokerError::connection("publishing to `orders`")
///     .caused_by(std::io::Error::other("connection reset by peer"));
/// assert_eq!(
///     ErrorChain(&e).to_string(),
///     "connection lost: publishing to `orders`: connection reset by peer"
/// );
/// ```
#[derive(Debug)]
pub struct ErrorChain<'a>(pub &'a (dyn StdError + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = self.0.to_string();
        let mut link = self.0.source();
        while let Some(inner) = link {
            let s = inner.to_string();
            if !text.contains(&s) {
                text.push_str(": ");
                text.push_str(&s);
            }
            link = inner.source();
        }
        f.write_str(&text)
    }
}

type Rule = Arc<dyn Fn(&(dyn StdError + 'static)) -> Option<ErrorClass> + Send + Sync>;

/// Classifies errors by type. Cheap to clone.
#[derive(Clone, Default)]
pub struct Classifier {
    rules: Vec<(TypeId, Rule)>,
}

impl fmt::Debug for Classifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Classifier")
            .field("rules", &self.rules.len())
            .finish()
    }
}

impl Classifier {
    /// Classify errors of type `E` (found anywhere in the `source()` chain) with `rule`.
    /// Later rules for the same type replace earlier ones.
    pub fn on<E: StdError + 'static>(
        mut self,
        rule: impl Fn(&E) -> ErrorClass + Send + Sync + 'static,
    ) -> Self {
        let type_id = TypeId::of::<E>();
        self.rules.retain(|(t, _)| *t != type_id);
        self.rules.push((
            type_id,
            Arc::new(move |e: &(dyn StdError + 'static)| e.downcast_ref::<E>().map(&rule)),
        ));
        self
    }

    /// The class of `error`: the first link of its `source()` chain that a marker, a
    /// registered rule or a built-in rule recognises; otherwise [`ErrorClass::Unknown`].
    pub fn classify(&self, error: &(dyn StdError + 'static)) -> ErrorClass {
        let mut link: Option<&(dyn StdError + 'static)> = Some(error);
        while let Some(e) = link {
            if let Some(class) = self.classify_one(e) {
                return class;
            }
            link = e.source();
        }
        ErrorClass::Unknown
    }

    fn classify_one(&self, e: &(dyn StdError + 'static)) -> Option<ErrorClass> {
        if e.is::<Transient>() {
            return Some(ErrorClass::Transient);
        }
        if e.is::<Permanent>() {
            return Some(ErrorClass::Permanent);
        }
        if e.is::<Poison>() || e.is::<DecodeError>() {
            return Some(ErrorClass::Poison);
        }
        if let Some(codec) = e.downcast_ref::<CodecError>() {
            return Some(match codec {
                CodecError::Undecodable(_) => ErrorClass::Poison,
                CodecError::Unencodable(_) => ErrorClass::Permanent,
                CodecError::Unavailable { .. } => ErrorClass::Transient,
            });
        }
        if let Some(class) = self.rules.iter().find_map(|(_, rule)| rule(e)) {
            return Some(class);
        }
        if let Some(broker) = e.downcast_ref::<BrokerError>() {
            return match broker {
                // Transparent: its `source()` skips the wrapped error itself.
                BrokerError::Other(inner) => Some(self.classify(inner.as_ref())),
                known => broker_class(known),
            };
        }
        builtin(e)
    }
}

/// The class the built-in classifier gives a backend's error (`None`: ask its source).
fn broker_class(e: &BrokerError) -> Option<ErrorClass> {
    use ErrorClass::{Permanent, Transient};
    match e {
        // Nothing was delivered: another try may reach a broker that is back.
        BrokerError::Timeout(_)
        | BrokerError::Connection { .. }
        | BrokerError::Closed
        | BrokerError::Rejected { .. }
        | BrokerError::NotHeld(_) => Some(Transient),
        // No retry changes a missing route, a setting or a backend's abilities.
        BrokerError::Unroutable(_)
        | BrokerError::NotFound(_)
        | BrokerError::Config { .. }
        | BrokerError::Unauthorized { .. }
        | BrokerError::Unsupported { .. }
        | BrokerError::ForeignDelivery => Some(Permanent),
        BrokerError::Other(_) => None,
    }
}

fn builtin(e: &(dyn StdError + 'static)) -> Option<ErrorClass> {
    if let Some(json) = e.downcast_ref::<serde_json::Error>() {
        return match json.classify() {
            // An I/O error while reading a payload is not the payload's fault.
            serde_json::error::Category::Io => Some(ErrorClass::Transient),
            _ => Some(ErrorClass::Poison),
        };
    }
    if e.is::<std::str::Utf8Error>() || e.is::<std::string::FromUtf8Error>() {
        return Some(ErrorClass::Poison);
    }
    if e.is::<tokio::time::error::Elapsed>() {
        return Some(ErrorClass::Transient);
    }
    if let Some(io) = e.downcast_ref::<std::io::Error>() {
        use std::io::ErrorKind::*;
        return match io.kind() {
            TimedOut | ConnectionReset | ConnectionAborted | ConnectionRefused | BrokenPipe
            | Interrupted | WouldBlock | NotConnected | AddrInUse | UnexpectedEof
            | ResourceBusy | HostUnreachable | NetworkUnreachable | NetworkDown => {
                Some(ErrorClass::Transient)
            }
            InvalidData | InvalidInput => Some(ErrorClass::Permanent),
            // Other kinds wrap arbitrary errors; let the chain (or Unknown) decide.
            _ => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Outer(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("the error text says permanent but the type says nothing")]
    struct Misleading;

    fn classify(e: BoxError) -> ErrorClass {
        Classifier::default().classify(e.as_ref())
    }

    #[test]
    fn markers_win() {
        assert_eq!(
            classify(Box::new(Transient::msg("x"))),
            ErrorClass::Transient
        );
        assert_eq!(
            classify(Box::new(Permanent::msg("x"))),
            ErrorClass::Permanent
        );
        assert_eq!(classify(Box::new(Poison::msg("x"))), ErrorClass::Poison);
    }

    #[test]
    fn outermost_recognised_link_wins() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "t");
        assert_eq!(
            classify(Box::new(Permanent::new(io))),
            ErrorClass::Permanent
        );
    }

    #[test]
    fn walks_the_source_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(classify(Box::new(Outer(io))), ErrorClass::Transient);
    }

    #[test]
    fn text_is_never_used() {
        assert_eq!(classify(Box::new(Misleading)), ErrorClass::Unknown);
        assert_eq!(
            classify("permanent poison transient".into()),
            ErrorClass::Unknown
        );
    }

    #[test]
    fn decode_errors_are_poison() {
        let json = serde_json::from_slice::<u32>(b"{").unwrap_err();
        assert_eq!(classify(Box::new(json)), ErrorClass::Poison);
        let bytes = std::hint::black_box([0xffu8]);
        let utf8 = std::str::from_utf8(&bytes).unwrap_err();
        assert_eq!(
            classify(Box::new(DecodeError::from(utf8))),
            ErrorClass::Poison
        );
    }

    #[test]
    fn reliq_broker_errors_are_classified_by_variant() {
        use crate::error::BrokerError;
        let timeout = BrokerError::Timeout(std::time::Duration::from_secs(5));
        assert_eq!(classify(Box::new(timeout)), ErrorClass::Transient);
        let lost = BrokerError::connection("publishing").caused_by(Misleading);
        assert_eq!(classify(Box::new(lost)), ErrorClass::Transient);
        let nowhere = BrokerError::Unroutable("orders".into());
        assert_eq!(classify(Box::new(nowhere)), ErrorClass::Permanent);
        let config = BrokerError::Config {
            field: "url".into(),
            reason: "no host".into(),
        };
        assert_eq!(classify(Box::new(config)), ErrorClass::Permanent);
        // A handler's own error that wraps a broker error.
        #[derive(Debug, thiserror::Error)]
        #[error("reserving stock")]
        struct Reserve(#[source] BrokerError);
        let wrapped = Reserve(BrokerError::Timeout(std::time::Duration::ZERO));
        assert_eq!(classify(Box::new(wrapped)), ErrorClass::Transient);
        // `Other` is transparent: the wrapped error decides.
        let other = BrokerError::Other(Box::new(Misleading));
        assert_eq!(classify(Box::new(other)), ErrorClass::Unknown);
        let other = BrokerError::Other(Box::new(Permanent::msg("bad")));
        assert_eq!(classify(Box::new(other)), ErrorClass::Permanent);
    }

    #[test]
    fn broker_errors_keep_their_cause() {
        use std::error::Error as _;
        let e = crate::error::BrokerError::rejected("nack").caused_by(Misleading);
        assert!(e.source().is_some_and(|s| s.is::<Misleading>()));
    }

    #[test]
    fn registered_rules_see_inner_links() {
        let c = Classifier::default().on::<Misleading>(|_| ErrorClass::Permanent);
        let e: BoxError = Box::new(Transient::new(Misleading));
        // the marker is outermost, so it wins over the rule for the inner type
        assert_eq!(c.classify(e.as_ref()), ErrorClass::Transient);
        let e: BoxError = Box::new(Misleading);
        assert_eq!(c.classify(e.as_ref()), ErrorClass::Permanent);
    }
}
