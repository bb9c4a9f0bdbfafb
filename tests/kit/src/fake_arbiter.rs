//! A fake arbiter for the interposer's tests (moved here from libgpushare.so).
