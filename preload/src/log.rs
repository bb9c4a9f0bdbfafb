//! Logging to stderr, only when `GPUSHARE_LOG` asks for it, and only on cold paths
//! (connection changes, refusals, unexpected driver answers): never on a launch.

use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Level {
    Off = 0,
    Error = 1,
    Info = 2,
    Debug = 3,
}

impl Level {
    /// `error`, `info`, `debug`; `0`/`off`/empty turn it off; anything else means info.
    pub fn parse(value: &str) -> Level {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "off" | "none" => Level::Off,
            "error" | "warn" => Level::Error,
            "debug" | "trace" => Level::Debug,
            _ => Level::Info,
        }
    }
}

static LEVEL: AtomicU8 = AtomicU8::new(Level::Off as u8);

pub fn set_level(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

#[inline]
pub fn enabled(level: Level) -> bool {
    LEVEL.load(Ordering::Relaxed) >= level as u8
}

#[doc(hidden)]
#[cold]
pub fn write(level: Level, args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let tag = match level {
        Level::Error => "error",
        Level::Info => "info",
        _ => "debug",
    };
    // One write per line, so lines of concurrent threads do not interleave.
    let line = format!("gpushare[{}] {tag}: {args}\n", std::process::id());
    let _ = std::io::stderr().write_all(line.as_bytes());
}

#[macro_export]
macro_rules! log_at {
    ($level:expr, $($arg:tt)*) => {
        if $crate::log::enabled($level) {
            $crate::log::write($level, format_args!($($arg)*));
        }
    };
}

#[macro_export]
macro_rules! log_error { ($($arg:tt)*) => { $crate::log_at!($crate::log::Level::Error, $($arg)*) }; }
#[macro_export]
macro_rules! log_info { ($($arg:tt)*) => { $crate::log_at!($crate::log::Level::Info, $($arg)*) }; }
#[macro_export]
macro_rules! log_debug { ($($arg:tt)*) => { $crate::log_at!($crate::log::Level::Debug, $($arg)*) }; }

#[cfg(test)]
mod tests {
    use super::Level;

    #[test]
    fn levels() {
        assert_eq!(Level::parse(""), Level::Off);
        assert_eq!(Level::parse("0"), Level::Off);
        assert_eq!(Level::parse("1"), Level::Info);
        assert_eq!(Level::parse("DEBUG"), Level::Debug);
        assert_eq!(Level::parse("error"), Level::Error);
    }
}
