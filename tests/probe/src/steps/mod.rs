//! The probe's steps, one function each, grouped by what they exercise.

pub(crate) mod captures;
pub(crate) mod contents;
pub(crate) mod contexts;
pub(crate) mod copies;
pub(crate) mod info;
pub(crate) mod launches;
pub(crate) mod memory;
pub(crate) mod process;
pub(crate) mod streams;
pub(crate) mod symbols;
