// The real driver's soname, so programs and the loader find it as `libcuda.so.1`; and
// -Bsymbolic so that the library's calls to its own functions never go through the dynamic
// linker (like the real driver): an interposer that only exports `cu*` names is not enough.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
}
