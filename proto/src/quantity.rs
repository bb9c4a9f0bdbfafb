//! Values a container can ask for: defined in `gpushare-types`, re-exported here so the
//! wire protocol names them where it always has.

pub use gpushare_types::quantity::*;
