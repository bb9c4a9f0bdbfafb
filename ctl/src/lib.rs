//! `gpusharectl`, the operator's command-line client of the arbiter: it talks to the
//! daemon only through the control protocol (`gpushare-proto`) and reads the same
//! configuration file (`gpushare-config`), so it never depends on the daemon's code.
//! Beside the binary: its command line (`cli`), the container engines' configuration
//! edits (`setup`), and the renderings of a status report (`top`, `timeline`).

pub mod cli;
pub mod setup;
pub mod terminal;
pub mod timeline;
pub mod top;
