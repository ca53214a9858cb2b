//! Which record a delivery is, packed into its token.

use reliq_core::{
    Delivery,
    seam::{DeliveryToken, ReceiverId},
};

/// Which record a delivery is, packed into its [`DeliveryToken`] without an allocation:
/// `tag` = offset; `lane` = a marker bit (63) | generation (bits 40–61, wrapping) |
/// client (bits 32–39) | partition (bits 0–31).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TokenInfo {
    pub(super) client: usize,
    pub(super) partition: i32,
    pub(super) offset: i64,
    /// The partition's assignment generation, masked to [`GENERATION_MASK`].
    pub(super) generation: u64,
}

const TOKEN_MARKER: u64 = 1 << 63;
pub(super) const GENERATION_MASK: u64 = (1 << 22) - 1;
/// Most Kafka consumers one receiver runs (source + relays), so a client index fits the
/// token's 8 bits.
pub(super) const MAX_CLIENTS: usize = 256;

impl TokenInfo {
    pub(super) fn token(self, owner: ReceiverId) -> DeliveryToken {
        let lane = TOKEN_MARKER
            | (self.generation & GENERATION_MASK) << 40
            | (self.client as u64 & 0xff) << 32
            | u64::from(self.partition as u32);
        DeliveryToken::new(owner, self.offset as u64).with_lane(lane as i64)
    }

    /// The record a delivery's token names (its receiver is checked at the seam,
    /// [`Shared::check`]).
    pub(super) fn of(d: &Delivery) -> Option<Self> {
        let t = d.token();
        let lane = t.lane() as u64;
        (lane & TOKEN_MARKER != 0).then_some(Self {
            client: ((lane >> 32) & 0xff) as usize,
            partition: lane as u32 as i32,
            offset: t.tag() as i64,
            generation: (lane >> 40) & GENERATION_MASK,
        })
    }
}

#[cfg(test)]
mod tests {
    use reliq_core::Message;
    use reliq_core::Origin;

    use super::*;

    #[test]
    fn the_token_packs_client_partition_offset_and_generation() {
        let info = TokenInfo {
            client: 255,
            partition: i32::MAX,
            offset: 9_000_000_000,
            generation: GENERATION_MASK,
        };
        let owner = ReceiverId::next();
        let d = Delivery::new(Message::new("x"), 1, Origin::default(), info.token(owner));
        assert_eq!(TokenInfo::of(&d), Some(info));
        assert_eq!(d.token().receiver(), owner);
        let wrapped = TokenInfo {
            generation: GENERATION_MASK + 5,
            ..info
        };
        let d = Delivery::new(
            Message::new("x"),
            1,
            Origin::default(),
            wrapped.token(owner),
        );
        assert_eq!(TokenInfo::of(&d).map(|i| i.generation), Some(4));
        let foreign = Delivery::new(
            Message::new("x"),
            1,
            Origin::default(),
            DeliveryToken::new(owner, 7),
        );
        assert_eq!(TokenInfo::of(&foreign), None, "not a Kafka delivery");
    }
}
