//! `gpusharectl`, the operator's command-line client of the arbiter: it talks to the
//! daemon only through the control protocol (`gpushare-proto`) and reads the same
//! configuration file (`gpushare-config`), so it never depends on the daemon's code.
//! Beside the binary: its command line (`cli`), the container engines' configuration
//! edits (`setup`), and the text views (`status`, `list`, `top`, `timeline`, sharing
//! `render`'s width, names and units).

pub mod cli;
#[cfg(test)]
mod fixtures;
pub mod list;
pub mod render;
pub mod setup;
pub mod status;
pub mod terminal;
pub mod timeline;
pub mod top;
