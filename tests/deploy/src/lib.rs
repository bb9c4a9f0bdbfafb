//! See tests/.
