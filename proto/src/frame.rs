//! Framing: a 4-byte big-endian length, then that many bytes of JSON.
//!
//! The length bound is checked before anything is allocated, so a hostile peer
//! cannot make the arbiter reserve memory by announcing a huge frame.

use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Far above any real message (a status report with hundreds of leases is ~100 KiB).
pub const MAX_FRAME_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("frame of {len} bytes exceeds the limit of {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error(transparent)]
    Io(io::Error),
}

impl From<io::Error> for FrameError {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Closed
        } else {
            FrameError::Io(e)
        }
    }
}

pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(message)?;
    if body.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge {
            len: body.len(),
            limit: MAX_FRAME_BYTES,
        });
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Reads the 4-byte header; returns the body length after checking the bound.
pub fn body_len(header: [u8; 4]) -> Result<usize, FrameError> {
    body_len_within(header, MAX_FRAME_BYTES)
}

/// [`body_len`] with a tighter bound, for a socket whose messages are all small.
pub fn body_len_within(header: [u8; 4], limit: usize) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(header) as usize;
    if len > limit.min(MAX_FRAME_BYTES) {
        return Err(FrameError::TooLarge {
            len,
            limit: limit.min(MAX_FRAME_BYTES),
        });
    }
    Ok(len)
}

pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    Ok(serde_json::from_slice(body)?)
}

pub fn write_message<T: Serialize>(w: &mut impl Write, message: &T) -> Result<(), FrameError> {
    w.write_all(&encode(message)?)?;
    w.flush()?;
    Ok(())
}

pub fn read_message<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, FrameError> {
    let mut header = [0u8; 4];
    r.read_exact(&mut header)?;
    let mut body = vec![0u8; body_len(header)?];
    r.read_exact(&mut body)?;
    decode(&body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::ControlRequest;

    #[test]
    fn round_trip() {
        let msg = ControlRequest::Hello { protocol: 7 };
        let bytes = encode(&msg).unwrap();
        let back: ControlRequest = read_message(&mut bytes.as_slice()).unwrap();
        assert_eq!(back, msg);
    }

    #[test]
    fn oversized_header_is_refused_before_reading_the_body() {
        let header = ((MAX_FRAME_BYTES + 1) as u32).to_be_bytes();
        let err = read_message::<ControlRequest>(&mut header.as_slice()).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn truncated_and_garbage_frames_are_errors() {
        let mut bytes = encode(&ControlRequest::Status).unwrap();
        bytes.truncate(bytes.len() - 1);
        assert!(matches!(
            read_message::<ControlRequest>(&mut bytes.as_slice()),
            Err(FrameError::Closed)
        ));
        let mut garbage = 3u32.to_be_bytes().to_vec();
        garbage.extend_from_slice(b"{x}");
        assert!(matches!(
            read_message::<ControlRequest>(&mut garbage.as_slice()),
            Err(FrameError::Malformed(_))
        ));
    }
}
