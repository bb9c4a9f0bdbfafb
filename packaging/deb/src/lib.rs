// Nothing to compile: see Cargo.toml.
