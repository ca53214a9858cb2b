//! The schema-registry wire format (Confluent's): a magic byte `0`, the schema id as a
//! 4-byte big-endian integer, for Protobuf the message indexes, then the body.

use reliq_core::CodecError;

/// The first byte of a registry-framed payload.
pub const MAGIC: u8 = 0;

/// What the framing says about a payload.
#[derive(Debug, PartialEq, Eq)]
pub struct Framed<'a> {
    /// The writer's schema id.
    pub schema_id: u32,
    /// The rest: the body, and for Protobuf the message indexes before it.
    pub rest: &'a [u8],
}

const FORMAT: &str = "schema-registry framing";

/// Write the frame's header for `schema_id` into `out`.
pub fn write_header(out: &mut Vec<u8>, schema_id: u32) {
    out.push(MAGIC);
    out.extend_from_slice(&schema_id.to_be_bytes());
}

/// Read the header of a registry-framed payload. A payload without it (too short, or
/// another first byte: a plain JSON or Avro body, a foreign producer) is undecodable.
pub fn read_header(payload: &[u8]) -> Result<Framed<'_>, CodecError> {
    match payload {
        [MAGIC, a, b, c, d, rest @ ..] => Ok(Framed {
            schema_id: u32::from_be_bytes([*a, *b, *c, *d]),
            rest,
        }),
        [MAGIC, ..] => Err(CodecError::undecodable(
            FORMAT,
            format!(
                "{} bytes, shorter than the 5-byte header (magic byte and schema id)",
                payload.len()
            ),
        )),
        [other, ..] => Err(CodecError::undecodable(
            FORMAT,
            format!(
                "the first byte is {other:#04x}, not the magic byte 0x00: not a registry-framed payload"
            ),
        )),
        [] => Err(CodecError::undecodable(FORMAT, "the payload is empty")),
    }
}

/// Write Protobuf message indexes (the path of the message type in its `.proto` file):
/// their count then each, as zig-zag varints; `[0]` (the first message) as one `0` byte.
pub fn write_message_indexes(out: &mut Vec<u8>, indexes: &[i32]) {
    if indexes == [0] {
        out.push(0);
        return;
    }
    write_zigzag(out, indexes.len() as i64);
    for index in indexes {
        write_zigzag(out, i64::from(*index));
    }
}

/// Read Protobuf message indexes; returns them and the body after them.
pub fn read_message_indexes(rest: &[u8]) -> Result<(Vec<i32>, &[u8]), CodecError> {
    let (count, mut rest) = read_zigzag(rest)?;
    if count == 0 {
        return Ok((vec![0], rest));
    }
    if !(1..=64).contains(&count) {
        return Err(CodecError::undecodable(
            FORMAT,
            format!(
                "{count} Protobuf message indexes (a message nested that deep is not a message type)"
            ),
        ));
    }
    let mut indexes = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let (index, after) = read_zigzag(rest)?;
        let index = i32::try_from(index).map_err(|_| {
            CodecError::undecodable(FORMAT, format!("message index {index} out of range"))
        })?;
        indexes.push(index);
        rest = after;
    }
    Ok((indexes, rest))
}

fn write_zigzag(out: &mut Vec<u8>, value: i64) {
    let mut n = ((value << 1) ^ (value >> 63)) as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn read_zigzag(bytes: &[u8]) -> Result<(i64, &[u8]), CodecError> {
    let mut n: u64 = 0;
    for (i, byte) in bytes.iter().enumerate().take(10) {
        n |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            let value = ((n >> 1) as i64) ^ -((n & 1) as i64);
            return Ok((value, &bytes[i + 1..]));
        }
    }
    Err(CodecError::undecodable(
        FORMAT,
        "the Protobuf message indexes end in the middle of a varint",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let mut out = Vec::new();
        write_header(&mut out, 0x0102_0304);
        out.extend_from_slice(b"body");
        assert_eq!(out[..5], [0, 1, 2, 3, 4]);
        assert_eq!(
            read_header(&out).unwrap(),
            Framed {
                schema_id: 0x0102_0304,
                rest: b"body"
            }
        );
    }

    #[test]
    fn unframed_payloads_are_undecodable_with_a_reason() {
        let err = read_header(br#"{"order":"o-1"}"#).unwrap_err();
        assert!(err.to_string().contains("not the magic byte"), "{err}");
        let err = read_header(&[0, 0, 1]).unwrap_err();
        assert!(
            err.to_string().contains("shorter than the 5-byte header"),
            "{err}"
        );
        assert!(read_header(&[]).is_err());
    }

    #[test]
    fn message_indexes_round_trip_and_first_message_is_one_byte() {
        let mut out = Vec::new();
        write_message_indexes(&mut out, &[0]);
        assert_eq!(out, [0]);
        for path in [vec![0], vec![1], vec![2, 0, 70], vec![300]] {
            let mut out = Vec::new();
            write_message_indexes(&mut out, &path);
            out.extend_from_slice(b"x");
            let (read, body) = read_message_indexes(&out).unwrap();
            assert_eq!(read, path);
            assert_eq!(body, b"x");
        }
        // [1] is count 1 (zig-zag 2), index 1 (zig-zag 2): Confluent's bytes.
        let mut out = Vec::new();
        write_message_indexes(&mut out, &[1]);
        assert_eq!(out, [2, 2]);
        assert!(read_message_indexes(&[0x80]).is_err());
    }
}
