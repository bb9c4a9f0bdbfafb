//! Where benchmarks leave their figures for `gpushare-bench`'s report.

/// `GPUSHARE_BENCH_RESULTS=dir` also writes a benchmark's figures as JSON to
/// `dir/{name}.json` (`make bench`: tests/bench/results, gathered by gpushare-bench's
/// control-path section). Without it, nothing is written.
pub fn write_results(name: &str, figures: serde_json::Value) {
    if let Some(dir) = std::env::var_os("GPUSHARE_BENCH_RESULTS") {
        let path = std::path::Path::new(&dir).join(format!("{name}.json"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&figures).unwrap() + "\n",
        )
        .unwrap();
        println!("wrote {}", path.display());
    }
}
