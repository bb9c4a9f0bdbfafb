//! Values of the time-slice token that configuration also names.

/// What a client does while it cannot reach the arbiter (restart, crash), per class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum LossPolicy {
    /// Submit ungated until the arbiter is back.
    Run,
    /// Submit nothing until the arbiter is back (and grants the token).
    Wait,
}
