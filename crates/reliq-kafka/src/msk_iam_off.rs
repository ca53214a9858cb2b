//! AWS MSK IAM without the `msk-iam` feature: a URL that asks for it fails at connect,
//! naming the feature. The same names as `msk_iam.rs`, so the rest of the crate has no
//! feature switches.

use crate::error::KafkaError;
use crate::options::MskIamSettings;

/// A token and when it expires (never made without the feature).
pub(crate) struct Token {
    pub(crate) value: String,
    pub(crate) expires_at_ms: i64,
}

/// Never built without the feature.
pub(crate) enum MskIam {}

impl MskIam {
    pub(crate) fn new(_: &MskIamSettings) -> Result<Self, KafkaError> {
        Err(KafkaError::Config {
            field: "sasl.oauthbearer.method".into(),
            reason:
                "aws_msk_iam needs the `msk-iam` feature of reliq-kafka (`kafka-msk-iam` of reliq)"
                    .into(),
        })
    }

    pub(crate) fn token(&self) -> Result<Token, String> {
        match *self {}
    }
}
