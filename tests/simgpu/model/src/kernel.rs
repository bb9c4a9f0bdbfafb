//! How a launch says how long its kernel runs, and which kernels a module image declares.
//!
//! The simulated GPU runs no code, so the duration travels in the launch itself: as the first
//! kernel parameter (a `u64` of nanoseconds) of `gpushare_spin_ns`, the portable PTX kernel in
//! `tests/simgpu/ptx/spin.ptx` that spins on `%globaltimer` for that long on a real GPU; or in
//! the function name (`sleep_250us`, `sleep_2ms`,
//! `sleep_1500ns`, `sleep_1s`), for test images that declare such entries.

/// The portable kernel whose first parameter is its duration in nanoseconds.
pub const SPIN_KERNEL_NAME: &str = "gpushare_spin_ns";
/// The PTX text of `gpushare_spin_ns` (also at `tests/simgpu/ptx/spin.ptx`).
pub const SPIN_PTX: &str = include_str!("../../ptx/spin.ptx");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelDuration {
    /// Fixed by the function name.
    Fixed(u64),
    /// Read from the first kernel parameter at launch.
    FirstParam,
    /// The name encodes nothing: the configured default applies.
    Default,
}

impl KernelDuration {
    pub fn from_function_name(name: &str) -> KernelDuration {
        if name == SPIN_KERNEL_NAME {
            return KernelDuration::FirstParam;
        }
        match name.strip_prefix("sleep_").and_then(parse_duration) {
            Some(ns) => KernelDuration::Fixed(ns),
            None => KernelDuration::Default,
        }
    }
}

/// What `cuModuleLoadData` finds in an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModuleImage {
    /// PTX text and the kernels (`.entry`) it declares, in order.
    Ptx(Vec<String>),
    /// A cubin (ELF) or fatbinary: the simulator cannot read which kernels it holds.
    Binary,
    /// Text that claims to be PTX (it has `.entry` or `.version`) but lacks its header.
    InvalidPtx,
    /// Anything else.
    Invalid,
}

const ELF_MAGIC: &[u8] = b"\x7fELF";
/// `FATBIN_MAGIC` 0xBA55ED50, little-endian.
const FATBIN_MAGIC: &[u8] = &[0x50, 0xed, 0x55, 0xba];

impl ModuleImage {
    /// Classifies an image given its first bytes up to (not including) a NUL, or the 4-byte
    /// magic of a binary image.
    pub fn parse(bytes: &[u8]) -> ModuleImage {
        if bytes.starts_with(ELF_MAGIC) || bytes.starts_with(FATBIN_MAGIC) {
            return ModuleImage::Binary;
        }
        let text = strip_comments(&String::from_utf8_lossy(bytes));
        let has = |directive: &str| {
            text.split(|c: char| c.is_whitespace())
                .any(|token| token == directive)
        };
        // The real driver's PTX JIT rejects a module without `.version` and `.target` first
        // thing; `.address_size` is optional (defaults to 32).
        if has(".version") && has(".target") {
            return ModuleImage::Ptx(ptx_entries(&text));
        }
        if has(".version") || text.contains(".entry") {
            return ModuleImage::InvalidPtx;
        }
        ModuleImage::Invalid
    }

    /// Whether `name` is a kernel of this image.
    pub fn declares(&self, name: &str) -> bool {
        match self {
            ModuleImage::Ptx(entries) => entries.iter().any(|e| e == name),
            _ => false,
        }
    }
}

fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |i| &after[i..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |i| &after[i + 2..]);
            out.push(' ');
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The names after each `.entry` directive (a PTX identifier: letters, digits, `_`, `$`, and
/// `%` after the first character).
fn ptx_entries(text: &str) -> Vec<String> {
    let mut entries = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(".entry") {
        let after = &rest[i + ".entry".len()..];
        rest = after;
        if !after.starts_with(|c: char| c.is_whitespace()) {
            continue;
        }
        let name: String = after
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '%'))
            .collect();
        if !name.is_empty() {
            entries.push(name);
        }
    }
    entries
}

/// A PTX module declaring one kernel per name (test images for `sleep_*` names); the bodies
/// only return, which is all the simulator needs and what a real driver would accept.
pub fn ptx_with_entries(names: &[&str]) -> String {
    let mut ptx = String::from(".version 7.0\n.target sm_75\n.address_size 64\n");
    for name in names {
        ptx.push_str(&format!(".visible .entry {name}()\n{{\n\tret;\n}}\n"));
    }
    ptx
}

/// Parses `250us`, `2ms`, `1500ns`, `1s`.
pub fn parse_duration(text: &str) -> Option<u64> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let mult = match unit {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_declare_their_entries() {
        assert_eq!(
            ModuleImage::parse(SPIN_PTX.as_bytes()),
            ModuleImage::Ptx(vec![SPIN_KERNEL_NAME.to_string()])
        );
        let ptx = ptx_with_entries(&["sleep_20ms", "sleep_100us"]);
        let image = ModuleImage::parse(ptx.as_bytes());
        assert!(image.declares("sleep_20ms") && image.declares("sleep_100us"));
        assert!(!image.declares("sleep_1ms"), "not declared: not found");
        assert!(!image.declares("sleep_20"), "a prefix is not a name");
        let commented = ".version 7.0\n.target sm_80 // .entry hidden\n/* .entry also_hidden */\n\
                         .entry visible_one (.param .u64 a) { ret; }";
        assert_eq!(
            ModuleImage::parse(commented.as_bytes()),
            ModuleImage::Ptx(vec!["visible_one".to_string()])
        );
        // The pre-PTX test image of earlier versions: a real driver rejects it, so does this.
        assert_eq!(ModuleImage::parse(b"simgpu"), ModuleImage::Invalid);
        assert_eq!(ModuleImage::parse(b"x"), ModuleImage::Invalid);
        assert_eq!(ModuleImage::parse(b"\x7fELF\x02\x01"), ModuleImage::Binary);
        assert_eq!(
            ModuleImage::parse(b".entry k() { ret; }"),
            ModuleImage::InvalidPtx,
            "no .version/.target header"
        );
    }

    #[test]
    fn names_encode_durations() {
        let table = [
            ("sleep_250us", KernelDuration::Fixed(250_000)),
            ("sleep_2ms", KernelDuration::Fixed(2_000_000)),
            ("sleep_1500ns", KernelDuration::Fixed(1_500)),
            ("sleep_1s", KernelDuration::Fixed(1_000_000_000)),
            ("simgpu_kernel", KernelDuration::Default),
            ("gpushare_spin_ns", KernelDuration::FirstParam),
            ("gemm_kernel", KernelDuration::Default),
            ("sleep_", KernelDuration::Default),
            ("sleep_5", KernelDuration::Default),
            ("sleep_5h", KernelDuration::Default),
            ("sleep_ms", KernelDuration::Default),
        ];
        for (name, want) in table {
            assert_eq!(KernelDuration::from_function_name(name), want, "{name}");
        }
    }
}
