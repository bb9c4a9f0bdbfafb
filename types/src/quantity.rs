//! Values a container can ask for, and the one grammar that reads them.
//!
//! Configuration files, annotations and environment variables all share these
//! parsers so `8Gi` means the same thing everywhere. Every error says which
//! forms are accepted; the caller adds which key the value came from.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantityError {
    /// Human-readable list of the accepted forms, for the error message.
    pub accepted: &'static str,
}

impl fmt::Display for QuantityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "expected {}", self.accepted)
    }
}

impl std::error::Error for QuantityError {}

pub const PRIORITY_FORMS: &str = "`high` or `low`";
pub const BYTES_FORMS: &str =
    "a byte count with an optional unit: 1073741824, 512Mi, 8Gi, 8G, 1.5Gi (binary Ki Mi Gi Ti in any case, 8GiB too; decimal K M G T, upper case)";
pub const MEMORY_FORMS: &str =
    "bytes with a unit (512Mi, 8Gi, 8G, 1073741824) or a fraction of the GPU greater than 0 and at most 1 (0.4, 40%)";
pub const FRACTION_FORMS: &str = "a fraction from 0 to 1 (0.25, 0.5, 1) or a percentage (25%)";
pub const GPU_FORMS: &str =
    "`count:N` (N from 1), `index:I[,J…]` (GPU indices) or `uuid:GPU-…[,GPU-…]` (GPU UUIDs)";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Priority {
    #[default]
    Low,
    High,
}

impl FromStr for Priority {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "high" => Ok(Priority::High),
            "low" => Ok(Priority::Low),
            _ => Err(QuantityError {
                accepted: PRIORITY_FORMS,
            }),
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Priority::High => "high",
            Priority::Low => "low",
        })
    }
}

/// A number of bytes; reads `512Mi`, `8Gi`, `8G`, `1073741824`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_bytes(s).map(ByteSize).ok_or(QuantityError {
            accepted: BYTES_FORMS,
        })
    }
}

/// What a unit after a byte count means.
///
/// Which spellings are read, and why: the `i` of `Ki Mi Gi Ti` exists only in the
/// binary (IEC) prefixes, so `8gi`, `8GI`, `8GiB` and `8gib` can only mean 8 × 2^30
/// and are read so. `K M G T` in upper case alone are Kubernetes' decimal units
/// (`8G` = 8 × 10^9), as before. Everything else of that family reads two ways and
/// is refused with both readings (`ambiguous_bytes`): `8g`/`8m`/`8k` are binary to
/// docker's `--memory` but decimal (or, `m`, milli) to Kubernetes, and `8GB`/`8Gb`
/// are 8 × 10^9 in SI and 8 × 2^30 in JEDEC's (and most tools') usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Exact(u64),
    /// (binary multiplier, decimal multiplier, the prefix letter in upper case).
    Ambiguous(u64, u64, char),
    Unknown,
}

fn read_unit(unit: &str) -> Unit {
    let mut chars = unit.chars();
    let Some(letter) = chars.next() else {
        return Unit::Exact(1);
    };
    let upper = letter.to_ascii_uppercase();
    let Some(power) = "KMGT".find(upper) else {
        return Unit::Unknown;
    };
    let power = power as u32 + 1;
    let binary = 1u64 << (10 * power);
    let decimal = 1000u64.pow(power);
    let rest = chars.as_str();
    if rest.eq_ignore_ascii_case("i") || rest.eq_ignore_ascii_case("ib") {
        return Unit::Exact(binary);
    }
    match rest {
        "" if letter.is_ascii_uppercase() => Unit::Exact(decimal),
        "" | "B" | "b" => Unit::Ambiguous(binary, decimal, upper),
        _ => Unit::Unknown,
    }
}

/// The number and the unit after it (`"1.5Gi"` → `("1.5", "Gi")`).
fn split_unit(s: &str) -> (&str, &str) {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    s.split_at(split)
}

fn parse_bytes(s: &str) -> Option<u64> {
    let (number, unit) = split_unit(s);
    match read_unit(unit) {
        Unit::Exact(multiplier) => amount(number, multiplier, !unit.is_empty()),
        Unit::Ambiguous(..) | Unit::Unknown => None,
    }
}

/// `number` × `multiplier`, in whole bytes.
fn amount(number: &str, multiplier: u64, has_unit: bool) -> Option<u64> {
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(multiplier);
    }
    // Fractional amounts (1.5Gi) only make sense with a unit, and must come out whole.
    let value: f64 = number.parse().ok()?;
    if !has_unit || !value.is_finite() {
        return None;
    }
    let bytes = value * multiplier as f64;
    (bytes >= 0.0 && bytes < u64::MAX as f64 && bytes.fract() == 0.0).then_some(bytes as u64)
}

/// For a byte count whose unit reads two ways (`4GB`, `4g`: see `Unit`): each
/// reading that is a whole number of bytes, as its unambiguous spelling and the
/// bytes it means (`[("4Gi", 4294967296), ("4G", 4000000000)]`), for an error to
/// offer. Empty for anything else, read or refused.
pub fn ambiguous_bytes(s: &str) -> Vec<(String, u64)> {
    let (number, unit) = split_unit(s);
    let Unit::Ambiguous(binary, decimal, letter) = read_unit(unit) else {
        return Vec::new();
    };
    [
        (binary, format!("{number}{letter}i")),
        (decimal, format!("{number}{letter}")),
    ]
    .into_iter()
    .filter_map(|(multiplier, spelling)| Some((spelling, amount(number, multiplier, true)?)))
    .collect()
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [
            ("Ti", 1 << 40),
            ("Gi", 1 << 30),
            ("Mi", 1 << 20),
            ("Ki", 1 << 10),
        ];
        for (name, size) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{}", self.0 / size, name);
            }
        }
        write!(f, "{}", self.0)
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for ByteSize {
    /// Accepts a plain integer or a string with a unit, so configuration files can say `"16Gi"`.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match <Raw as serde::Deserialize>::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize(n)),
            Raw::Text(t) => t.parse().map_err(|e: QuantityError| {
                serde::de::Error::custom(format!("invalid size {t:?}: {e}"))
            }),
        }
    }
}

/// A number in [0, 1]: a compute share, or a fraction of a GPU's memory.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Fraction(f64);

impl Fraction {
    pub const ZERO: Fraction = Fraction(0.0);
    pub const ONE: Fraction = Fraction(1.0);

    pub fn new(value: f64) -> Option<Fraction> {
        (value.is_finite() && (0.0..=1.0).contains(&value)).then_some(Fraction(value))
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

impl FromStr for Fraction {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = QuantityError {
            accepted: FRACTION_FORMS,
        };
        let value = match percentage(s) {
            Some(percent) => plain_decimal(percent).ok_or(err.clone())? / 100.0,
            None => plain_decimal(s).ok_or(err.clone())?,
        };
        Fraction::new(value).ok_or(err)
    }
}

/// The number of a percentage: `40%`, or `40 percent`, the spelling the shim's error
/// messages use because containerd reads a shim's message as a Go format string
/// (shim/src/service.rs): a value copied back from such a message must still parse.
fn percentage(s: &str) -> Option<&str> {
    s.strip_suffix('%').or_else(|| s.strip_suffix(" percent"))
}

/// Rust's float parser also takes `inf`, `NaN` and `1e-3`; requests are plain decimals.
fn plain_decimal(s: &str) -> Option<f64> {
    let ok = !s.is_empty()
        && s.chars().all(|c| c.is_ascii_digit() || c == '.')
        && s.chars().filter(|&c| c == '.').count() <= 1
        && s != ".";
    ok.then(|| s.parse().ok()).flatten()
}

impl fmt::Display for Fraction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How much GPU memory a container asks for. Serialised in its text form
/// (`"16Gi"`, `"0.25"`), the same one users write.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryRequest {
    Bytes(u64),
    /// Of the chosen GPU's total memory; resolved to bytes by the arbiter at placement.
    Fraction(Fraction),
}

impl MemoryRequest {
    /// Bytes on a GPU with `total` bytes of memory.
    pub fn resolve(self, total: u64) -> u64 {
        match self {
            MemoryRequest::Bytes(b) => b,
            MemoryRequest::Fraction(f) => (f.get() * total as f64) as u64,
        }
    }
}

impl FromStr for MemoryRequest {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = QuantityError {
            accepted: MEMORY_FORMS,
        };
        // `0.4` and `40%` are fractions; an integer or anything with a unit is bytes.
        let looks_fractional = percentage(s).is_some()
            || (s.contains('.') && s.chars().all(|c| c.is_ascii_digit() || c == '.'));
        if looks_fractional {
            let fraction: Fraction = s.parse().map_err(|_| err.clone())?;
            if fraction.get() <= 0.0 {
                return Err(err);
            }
            return Ok(MemoryRequest::Fraction(fraction));
        }
        match s.parse::<ByteSize>() {
            Ok(ByteSize(0)) | Err(_) => Err(err),
            Ok(ByteSize(b)) => Ok(MemoryRequest::Bytes(b)),
        }
    }
}

impl fmt::Display for MemoryRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryRequest::Bytes(b) => write!(f, "{}", ByteSize(*b)),
            // `{:?}` always keeps the decimal point, so 1.0 cannot read back as one byte.
            MemoryRequest::Fraction(x) => write!(f, "{:?}", x.get()),
        }
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for MemoryRequest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for MemoryRequest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <String as serde::Deserialize>::deserialize(d)?;
        text.parse().map_err(|e: QuantityError| {
            serde::de::Error::custom(format!("invalid memory amount {text:?}: {e}"))
        })
    }
}

/// Which GPUs a container asks for. UUIDs are the stable identity; indices can
/// change when the driver reloads (Xiao et al.), so leases always record UUIDs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum GpuSelector {
    Count(u32),
    Index(Vec<u32>),
    Uuid(Vec<String>),
}

impl Default for GpuSelector {
    fn default() -> Self {
        GpuSelector::Count(1)
    }
}

impl GpuSelector {
    pub fn gpu_count(&self) -> usize {
        match self {
            GpuSelector::Count(n) => *n as usize,
            GpuSelector::Index(v) => v.len(),
            GpuSelector::Uuid(v) => v.len(),
        }
    }
}

impl FromStr for GpuSelector {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = QuantityError {
            accepted: GPU_FORMS,
        };
        let (kind, list) = s.split_once(':').ok_or(err.clone())?;
        let items: Vec<&str> = list.split(',').collect();
        if items.iter().any(|i| i.is_empty()) {
            return Err(err);
        }
        let selector = match kind {
            "count" if items.len() == 1 => GpuSelector::Count(
                items[0]
                    .parse()
                    .ok()
                    .filter(|&n: &u32| n >= 1)
                    .ok_or(err.clone())?,
            ),
            "index" => GpuSelector::Index(
                items
                    .iter()
                    .map(|i| i.parse::<u32>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| err.clone())?,
            ),
            "uuid" if items.iter().all(|u| is_gpu_uuid(u)) => {
                GpuSelector::Uuid(items.iter().map(|u| u.to_string()).collect())
            }
            _ => return Err(err),
        };
        let unique = match &selector {
            GpuSelector::Index(v) => {
                v.iter().collect::<std::collections::BTreeSet<_>>().len() == v.len()
            }
            GpuSelector::Uuid(v) => {
                v.iter().collect::<std::collections::BTreeSet<_>>().len() == v.len()
            }
            GpuSelector::Count(_) => true,
        };
        unique.then_some(selector).ok_or(err)
    }
}

/// NVIDIA's form: `GPU-` then a UUID (MIG devices, `MIG-…`, are not shared by gpushare).
fn is_gpu_uuid(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("GPU-") else {
        return false;
    };
    let groups: Vec<&str> = rest.split('-').collect();
    let lengths = [8, 4, 4, 4, 12];
    groups.len() == 5
        && groups
            .iter()
            .zip(lengths)
            .all(|(g, n)| g.len() == n && g.chars().all(|c| c.is_ascii_hexdigit()))
}

impl fmt::Display for GpuSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuSelector::Count(n) => write!(f, "count:{n}"),
            GpuSelector::Index(v) => {
                let list: Vec<String> = v.iter().map(|i| i.to_string()).collect();
                write!(f, "index:{}", list.join(","))
            }
            GpuSelector::Uuid(v) => write!(f, "uuid:{}", v.join(",")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_table() {
        let cases: &[(&str, Option<u64>)] = &[
            ("1073741824", Some(1 << 30)),
            ("512Mi", Some(512 << 20)),
            ("8Gi", Some(8 << 30)),
            ("8G", Some(8_000_000_000)),
            ("1.5Gi", Some(3 << 29)),
            ("1Ti", Some(1 << 40)),
            ("0", Some(0)),
            ("lots", None),
            // Binary units in any case, with or without B: the `i` says binary.
            ("8gi", Some(8 << 30)),
            ("8GI", Some(8 << 30)),
            ("8gI", Some(8 << 30)),
            ("8GiB", Some(8 << 30)),
            ("8gib", Some(8 << 30)),
            ("8GIB", Some(8 << 30)),
            ("512mi", Some(512 << 20)),
            ("4KiB", Some(4 << 10)),
            ("1tib", Some(1 << 40)),
            ("1.5gib", Some(3 << 29)),
            ("2T", Some(2_000_000_000_000)),
            ("3M", Some(3_000_000)),
            ("3K", Some(3_000)),
            // Two readings (`ambiguous_bytes` offers both): refused.
            ("8g", None),
            ("8m", None),
            ("8k", None),
            ("8t", None),
            ("8GB", None),
            ("8gb", None),
            ("8Gb", None),
            ("8gB", None),
            ("8KB", None),
            ("8kB", None),
            ("8MB", None),
            ("8TB", None),
            // Not units at all.
            ("8B", None),
            ("8iB", None),
            ("8Gx", None),
            ("8GiBs", None),
            ("8Gii", None),
            ("8Pi", None),
            ("8 Gi", None),
            ("-1Gi", None),
            ("1.5", None),
            (".5Gi", None),
            ("", None),
            ("Gi", None),
            ("99999999999999999999", None),
            ("20000000Ti", None),
            ("0.3Ki", None),
        ];
        for (input, want) in cases {
            assert_eq!(
                input.parse::<ByteSize>().ok().map(|b| b.0),
                *want,
                "input {input:?}"
            );
        }
    }

    #[test]
    fn ambiguous_units_offer_both_readings_in_whole_bytes() {
        let cases: &[(&str, &[(&str, u64)])] = &[
            ("4GB", &[("4Gi", 4 << 30), ("4G", 4_000_000_000)]),
            ("4gb", &[("4Gi", 4 << 30), ("4G", 4_000_000_000)]),
            ("4Gb", &[("4Gi", 4 << 30), ("4G", 4_000_000_000)]),
            ("4g", &[("4Gi", 4 << 30), ("4G", 4_000_000_000)]),
            ("512mb", &[("512Mi", 512 << 20), ("512M", 512_000_000)]),
            ("512m", &[("512Mi", 512 << 20), ("512M", 512_000_000)]),
            ("1k", &[("1Ki", 1024), ("1K", 1000)]),
            ("2TB", &[("2Ti", 2 << 40), ("2T", 2_000_000_000_000)]),
            ("1.5GB", &[("1.5Gi", 3 << 29), ("1.5G", 1_500_000_000)]),
            // 1.1Ki is not a whole number of bytes: only the decimal reading is offered.
            ("1.1kb", &[("1.1K", 1100)]),
            // Read, or refused for another reason: nothing to offer.
            ("4Gi", &[]),
            ("4gib", &[]),
            ("4G", &[]),
            ("4", &[]),
            ("lots", &[]),
            ("GB", &[]),
            ("4Gx", &[]),
            ("99999999999999999999GB", &[]),
        ];
        for (input, want) in cases {
            let got = ambiguous_bytes(input);
            let want: Vec<(String, u64)> = want.iter().map(|(s, b)| (s.to_string(), *b)).collect();
            assert_eq!(got, want, "input {input:?}");
            // What is offered is itself read, to the bytes it names.
            for (spelling, bytes) in got {
                assert_eq!(
                    spelling.parse::<ByteSize>(),
                    Ok(ByteSize(bytes)),
                    "{spelling}"
                );
            }
        }
    }

    #[test]
    fn memory_request_table() {
        let f = |x| MemoryRequest::Fraction(Fraction::new(x).unwrap());
        let cases: &[(&str, Option<MemoryRequest>)] = &[
            ("1Gi", Some(MemoryRequest::Bytes(1 << 30))),
            ("0.4", Some(f(0.4))),
            ("40%", Some(f(0.4))),
            ("100%", Some(f(1.0))),
            ("40 percent", Some(f(0.4))),
            ("40percent", None),
            (" percent", None),
            ("1.0", Some(f(1.0))),
            ("1", Some(MemoryRequest::Bytes(1))),
            ("0", None),
            ("0.0", None),
            ("0%", None),
            ("1.5", None),
            ("150%", None),
            ("lots", None),
            ("NaN", None),
            ("inf", None),
            ("1e3", None),
            ("4gi", Some(MemoryRequest::Bytes(4 << 30))),
            ("4GiB", Some(MemoryRequest::Bytes(4 << 30))),
            ("4G", Some(MemoryRequest::Bytes(4_000_000_000))),
            ("4GB", None),
            ("4g", None),
        ];
        for (input, want) in cases {
            assert_eq!(
                input.parse::<MemoryRequest>().ok(),
                *want,
                "input {input:?}"
            );
        }
        assert_eq!(f(0.25).resolve(16 << 30), 4 << 30);
    }

    #[test]
    fn fraction_and_priority_table() {
        assert_eq!("0.5".parse::<Fraction>().unwrap().get(), 0.5);
        assert_eq!("25%".parse::<Fraction>().unwrap().get(), 0.25);
        assert_eq!("25 percent".parse::<Fraction>().unwrap().get(), 0.25);
        assert_eq!("0".parse::<Fraction>().unwrap().get(), 0.0);
        for bad in [
            "1.01",
            "-0.1",
            "half",
            "NaN",
            "",
            "%",
            "1e-1",
            "25  percent",
            "25 %",
        ] {
            assert!(bad.parse::<Fraction>().is_err(), "{bad:?}");
        }
        assert_eq!("high".parse::<Priority>(), Ok(Priority::High));
        assert_eq!("low".parse::<Priority>(), Ok(Priority::Low));
        assert!("High".parse::<Priority>().is_err());
    }

    #[test]
    fn gpu_selector_table() {
        let uuid = "GPU-51a6d0e0-0000-4000-8000-000000000001";
        let cases: Vec<(String, Option<GpuSelector>)> = vec![
            ("count:1".into(), Some(GpuSelector::Count(1))),
            ("count:2".into(), Some(GpuSelector::Count(2))),
            ("index:0,3".into(), Some(GpuSelector::Index(vec![0, 3]))),
            (
                format!("uuid:{uuid}"),
                Some(GpuSelector::Uuid(vec![uuid.into()])),
            ),
            ("count:0".into(), None),
            ("count:1,2".into(), None),
            ("index:".into(), None),
            ("index:0,0".into(), None),
            ("index:a".into(), None),
            ("uuid:GPU-123".into(), None),
            (format!("uuid:{uuid},{uuid}"), None),
            ("2".into(), None),
            ("all".into(), None),
        ];
        for (input, want) in cases {
            assert_eq!(input.parse::<GpuSelector>().ok(), want, "input {input:?}");
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["512Mi", "8Gi", "1000"] {
            assert_eq!(s.parse::<ByteSize>().unwrap().to_string(), s);
        }
        for s in ["0.4", "1.0", "0.25", "512Mi", "1"] {
            let m: MemoryRequest = s.parse().unwrap();
            assert_eq!(m.to_string().parse::<MemoryRequest>().unwrap(), m, "{s}");
            #[cfg(feature = "serde")]
            {
                let json = serde_json::to_string(&m).unwrap();
                assert_eq!(
                    serde_json::from_str::<MemoryRequest>(&json).unwrap(),
                    m,
                    "{json}"
                );
            }
        }
        for s in [
            "count:3",
            "index:1,2",
            "uuid:GPU-51a6d0e0-0000-4000-8000-000000000001",
        ] {
            assert_eq!(s.parse::<GpuSelector>().unwrap().to_string(), s);
        }
    }
}
