//! `make gpu-check`: the real-hardware compatibility matrix (see
//! `gpushare_bench::gpu_check`).

fn main() -> std::process::ExitCode {
    gpushare_bench::gpu_check::main()
}
