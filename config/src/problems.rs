//! Reading a configuration file's text into a [`Config`], or into every problem it
//! has: each names its key as a dotted path (`runtime.library`,
//! `arbiter.devices[0].memory`), the value as written, the line, what is accepted
//! and, where one is likely, the fix (the nearest known key, the right spelling of
//! a memory size).
//!
//! [`Config::parse`], which every component calls, goes through [`read`], and so
//! does `check-config`: the two cannot disagree about a file.
//!
//! serde stops at the first error, so the text is first read as a plain TOML table
//! and deserialized from that; after each error the offending key is taken out and
//! the rest read again, so one run lists every unknown key and wrong type. The
//! semantic checks (`Config::validate`) run once the file is well-typed: run on a
//! file with keys taken out they would judge defaults the operator never wrote.

use std::fmt;

use gpushare_types::quantity::ambiguous_bytes;
use gpushare_types::{ByteSize, MemoryRequest};
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use crate::Config;

/// Past this many the file is most likely not a gpushare configuration at all.
const MAX_PROBLEMS: usize = 20;

/// The keys whose values are memory sizes (`ByteSize` or `MemoryRequest`).
const MEMORY_KEYS: [&str; 4] = [
    "default_memory",
    "context_memory_estimate",
    "memory_unit",
    "memory",
];

/// One thing wrong with a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted path of the key (`scheduler.slice_ms`); `None` for a TOML syntax error.
    pub key: Option<String>,
    /// The value as written in the file (or as read, for a semantic check).
    pub value: Option<String>,
    /// 1-based line in the file, where the key is written there.
    pub line: Option<usize>,
    /// What is wrong, and what is accepted.
    pub message: String,
    /// The likely fix.
    pub hint: Option<String>,
}

impl Problem {
    /// A key whose value is wrong.
    pub(crate) fn at(key: &str, value: impl fmt::Display, message: impl Into<String>) -> Problem {
        Problem {
            key: Some(key.to_owned()),
            value: Some(value.to_string()),
            line: None,
            message: message.into(),
            hint: None,
        }
    }

    /// A key as a whole (a list with a duplicate entry).
    pub(crate) fn about(key: &str, message: impl Into<String>) -> Problem {
        Problem {
            key: Some(key.to_owned()),
            value: None,
            line: None,
            message: message.into(),
            hint: None,
        }
    }

    /// The problem without its line: `key = value: message; hint`.
    pub fn describe(&self) -> String {
        let mut text = String::new();
        if let Some(key) = &self.key {
            text.push_str(key);
            if let Some(value) = &self.value {
                text.push_str(" = ");
                text.push_str(value);
            }
            text.push_str(": ");
        }
        text.push_str(&self.message);
        if let Some(hint) = &self.hint {
            text.push_str("; ");
            text.push_str(hint);
        }
        text
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(line) = self.line {
            write!(f, "line {line}: ")?;
        }
        f.write_str(&self.describe())
    }
}

/// The problems on one line, as `ConfigError::Invalid` shows them.
pub(crate) fn joined(problems: &[Problem]) -> String {
    let all: Vec<String> = problems.iter().map(Problem::to_string).collect();
    all.join("; and ")
}

/// The configuration `text` describes, or every problem it has (never none).
pub fn read(text: &str) -> Result<Config, Vec<Problem>> {
    let document = DeTable::parse(text).ok();
    let find = |steps: &[Step]| document.as_ref().and_then(|d| locate(text, d, steps));
    // What the components always did: serde straight from the text. It also reads
    // integers past i64 (into u64 fields, for the semantic checks to refuse by
    // name), which a plain TOML table cannot hold.
    let direct = toml::from_str::<Config>(text);
    let config = match direct {
        Ok(config) => config,
        Err(error) => {
            let mut problems = match toml::from_str::<toml::Table>(text) {
                Ok(table) => structural_problems(table, &find),
                Err(_) => Vec::new(),
            };
            if problems.is_empty() {
                problems.push(unlocated(text, &error));
            }
            in_file_order(&mut problems);
            return Err(problems);
        }
    };
    let mut found = config.validate();
    if found.is_empty() {
        return Ok(config);
    }
    for problem in &mut found {
        let steps = problem.key.as_deref().map(steps_of).unwrap_or_default();
        let (line, written) = find(&steps).unzip();
        problem.line = line;
        if problem.hint.is_none() {
            problem.hint = memory_hint(&steps, written.flatten().as_deref());
        }
    }
    in_file_order(&mut found);
    Err(found)
}

/// By line, those the file does not name (a default judged against a written
/// key) last, each group in the order found.
fn in_file_order(problems: &mut [Problem]) {
    problems.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
}

/// Every unknown key and wrong type of `table`, taking each out in turn.
fn structural_problems(
    table: toml::Table,
    find: &dyn Fn(&[Step]) -> Option<Located>,
) -> Vec<Problem> {
    let mut value = toml::Value::Table(table);
    let mut problems: Vec<Problem> = Vec::new();
    while let Err(error) = serde_path_to_error::deserialize::<_, Config>(value.clone()) {
        let steps = steps(error.path());
        let key = dotted(&steps);
        let message = error.inner().message().trim().to_owned();
        // A table whose broken entry was taken out misses it now: said already.
        let consequence = message.starts_with("missing field")
            && problems
                .iter()
                .any(|p| p.key.as_deref().is_some_and(|k| k.starts_with(&key)));
        if !consequence {
            problems.push(structural(&steps, message, find(&steps)));
        }
        if problems.len() >= MAX_PROBLEMS || !take_out(&mut value, &steps) {
            break;
        }
    }
    problems
}

/// Where a key is written: its line, and its value as written (`None` for a table).
type Located = (usize, Option<String>);

/// A step of a key's path: a table's key or an array's index.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Key(String),
    Index(usize),
}

fn steps(path: &serde_path_to_error::Path) -> Vec<Step> {
    use serde_path_to_error::Segment;
    path.iter()
        .filter_map(|segment| match segment {
            Segment::Map { key } => Some(Step::Key(key.clone())),
            Segment::Seq { index } => Some(Step::Index(*index)),
            Segment::Enum { .. } | Segment::Unknown => None,
        })
        .collect()
}

/// `runtime.library` → its steps (semantic problems name plain table keys).
fn steps_of(key: &str) -> Vec<Step> {
    key.split('.').map(|k| Step::Key(k.to_owned())).collect()
}

fn dotted(steps: &[Step]) -> String {
    let mut text = String::new();
    for step in steps {
        match step {
            Step::Key(key) if text.is_empty() => text.push_str(key),
            Step::Key(key) => {
                text.push('.');
                text.push_str(key);
            }
            Step::Index(index) => text.push_str(&format!("[{index}]")),
        }
    }
    text
}

/// Takes the innermost table key on `steps` out of `value`, so the rest can be
/// read again; false when there is none to take (the loop must stop).
fn take_out(value: &mut toml::Value, steps: &[Step]) -> bool {
    let Some(last_key) = steps.iter().rposition(|s| matches!(s, Step::Key(_))) else {
        return false;
    };
    let mut here = value;
    for step in &steps[..last_key] {
        let next = match (step, here) {
            (Step::Key(key), toml::Value::Table(table)) => table.get_mut(key),
            (Step::Index(index), toml::Value::Array(array)) => array.get_mut(*index),
            _ => None,
        };
        match next {
            Some(next) => here = next,
            None => return false,
        }
    }
    match (&steps[last_key], here) {
        (Step::Key(key), toml::Value::Table(table)) => table.remove(key).is_some(),
        _ => false,
    }
}

/// The line `steps` is written on, and its value as written (`None` for a table).
fn locate(text: &str, document: &Spanned<DeTable<'_>>, steps: &[Step]) -> Option<Located> {
    let mut table = Some(document.get_ref());
    let mut value: Option<&Spanned<DeValue<'_>>> = None;
    let mut at = None;
    for step in steps {
        match step {
            Step::Key(key) => {
                let (name, found) = table?.iter().find(|(k, _)| k.get_ref() == key)?;
                at = Some(name.span().start);
                value = Some(found);
            }
            Step::Index(index) => {
                let DeValue::Array(array) = value?.get_ref() else {
                    return None;
                };
                let found = array.get(*index)?;
                at = Some(found.span().start);
                value = Some(found);
            }
        }
        table = match value.map(Spanned::get_ref) {
            Some(DeValue::Table(t)) => Some(t),
            _ => None,
        };
    }
    let line = text[..at?].matches('\n').count() + 1;
    let written = value
        .filter(|v| !matches!(v.get_ref(), DeValue::Table(_)))
        .and_then(|v| text.get(v.span()))
        .map(|s| shortened(s.trim()));
    Some((line, written))
}

fn shortened(text: &str) -> String {
    const MOST: usize = 80;
    match text.char_indices().nth(MOST) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// The text's own error, where it is not one of a key (TOML syntax, a number too
/// large for any field): its line, from the parser's span.
fn unlocated(text: &str, error: &toml::de::Error) -> Problem {
    let line = error
        .span()
        .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
    Problem {
        key: None,
        value: None,
        line,
        message: format!("not valid TOML: {}", error.message().trim()),
        hint: None,
    }
}

/// An unknown key, an unknown value of a closed set or a wrong type, as a problem.
fn structural(steps: &[Step], message: String, located: Option<Located>) -> Problem {
    let (line, written) = match located {
        Some((line, written)) => (Some(line), written),
        None => (None, None),
    };
    let mut problem = Problem {
        key: Some(dotted(steps)).filter(|k| !k.is_empty()),
        value: written.clone(),
        line,
        message,
        hint: None,
    };
    if let Some((_, accepted)) = serde_unknown(&problem.message, "field") {
        let parent = dotted(&steps[..steps.len().saturating_sub(1)]);
        let name = match steps.last() {
            Some(Step::Key(name)) => name.as_str(),
            _ => "",
        };
        problem.message = if accepted.is_empty() {
            "unknown key: this table takes no keys".into()
        } else {
            format!("unknown key (accepted: {})", accepted.join(", "))
        };
        problem.hint = nearest(name, &accepted).map(|k| {
            if parent.is_empty() {
                format!("did you mean [{k}]?")
            } else {
                format!("did you mean {parent}.{k}?")
            }
        });
    } else if let Some((name, accepted)) = serde_unknown(&problem.message, "variant") {
        problem.message = format!("unknown value (accepted: {})", accepted.join(", "));
        problem.hint = nearest(&name, &accepted).map(|v| format!("did you mean \"{v}\"?"));
    }
    if problem.hint.is_none() {
        problem.hint = memory_hint(steps, written.as_deref());
    }
    problem
}

/// serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant"):
/// the name and the accepted ones.
fn serde_unknown(message: &str, what: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix(&format!("unknown {what} `"))?;
    let (name, rest) = rest.split_once('`')?;
    let accepted = rest
        .split_once("expected")
        .map(|(_, list)| {
            list.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    Some((name.to_owned(), accepted))
}

/// The accepted name `name` is most likely a slip for: the same name without its
/// unit suffix (`slice` for `slice_ms`), else the closest by edit distance within
/// a third of its length.
fn nearest<'a>(name: &str, accepted: &'a [String]) -> Option<&'a str> {
    let name = name.to_ascii_lowercase();
    let unitless = accepted.iter().find(|candidate| {
        ["_ms", "_us", "_seconds"]
            .iter()
            .any(|unit| candidate.strip_suffix(unit) == Some(name.as_str()))
    });
    if let Some(found) = unitless {
        return Some(found);
    }
    accepted
        .iter()
        .map(|candidate| (strsim::osa_distance(&name, candidate), candidate))
        .filter(|&(distance, candidate)| distance * 3 <= candidate.len().max(3))
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, candidate)| candidate.as_str())
}

/// For a memory key: the right spelling of what was written. A unit that reads two
/// ways (`4GB`, `4g`) gets both readings; spaces (`4 Gi`) are dropped; a bare
/// number is offered in GiB.
fn memory_hint(steps: &[Step], written: Option<&str>) -> Option<String> {
    let key = steps.iter().rev().find_map(|s| match s {
        Step::Key(k) => Some(k.as_str()),
        Step::Index(_) => None,
    })?;
    if !MEMORY_KEYS.contains(&key) {
        return None;
    }
    let written = written?;
    if !written.is_empty() && written.bytes().all(|b| b.is_ascii_digit()) {
        return Some(format!(
            "did you mean \"{written}Gi\"? a size is a string with its unit (\"512Mi\", \"{written}Gi\")"
        ));
    }
    let text = written.strip_prefix('"')?.strip_suffix('"')?;
    let readings = ambiguous_bytes(text);
    if !readings.is_empty() {
        let spelt: Vec<String> = readings
            .iter()
            .map(|(spelling, bytes)| format!("\"{spelling}\" ({bytes} bytes)"))
            .collect();
        return Some(format!(
            "the unit reads two ways: did you mean {}?",
            spelt.join(" or ")
        ));
    }
    let compact: String = text.split_whitespace().collect();
    let reads = compact.parse::<ByteSize>().is_ok() || compact.parse::<MemoryRequest>().is_ok();
    (compact != text && reads).then(|| format!("did you mean \"{compact}\"?"))
}

/// Below this a memory size written as a bare number is most likely a size whose
/// unit was left out (`memory = 16` for 16 GiB): no GPU, quota or overhead is that small.
const DOUBTFUL_BYTES: u64 = 1 << 20;

/// What the components accept but is most likely a slip, for `check-config` to
/// warn of: a memory size written as a bare number under 1 MiB, which reads as
/// that many bytes (`memory = 16`). A file that does not parse has none.
pub fn doubts(text: &str) -> Vec<Problem> {
    let Ok(document) = DeTable::parse(text) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    doubts_in(text, document.get_ref(), &mut Vec::new(), &mut found);
    in_file_order(&mut found);
    found
}

fn doubts_in(text: &str, table: &DeTable<'_>, path: &mut Vec<Step>, found: &mut Vec<Problem>) {
    for (key, value) in table.iter() {
        path.push(Step::Key(key.get_ref().to_string()));
        match value.get_ref() {
            DeValue::Table(inner) => doubts_in(text, inner, path, found),
            DeValue::Array(items) => {
                for (index, item) in items.iter().enumerate() {
                    if let DeValue::Table(inner) = item.get_ref() {
                        path.push(Step::Index(index));
                        doubts_in(text, inner, path, found);
                        path.pop();
                    }
                }
            }
            _ if MEMORY_KEYS.contains(&key.get_ref().as_ref()) => {
                let written = text.get(value.span()).unwrap_or_default().trim();
                let digits = written.trim_matches('"');
                let bytes = digits
                    .bytes()
                    .all(|b| b.is_ascii_digit())
                    .then(|| digits.parse::<u64>().ok())
                    .flatten();
                if let Some(bytes @ 1..DOUBTFUL_BYTES) = bytes {
                    found.push(Problem {
                        key: Some(dotted(path)),
                        value: Some(written.to_owned()),
                        line: Some(text[..key.span().start].matches('\n').count() + 1),
                        message: format!("read as {bytes} bytes"),
                        hint: memory_hint(path, Some(digits)),
                    });
                }
            }
            _ => {}
        }
        path.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(text: &str) -> Vec<Problem> {
        read(text).expect_err(text)
    }

    #[test]
    fn each_problem_names_its_key_value_line_and_fix() {
        for (text, key, value, line, message, hint) in [
            (
                "[runtime]\nlibary = \"/x.so\"\n",
                "runtime.libary",
                "\"/x.so\"",
                2,
                "unknown key (accepted: runtimes, library, container_library, hook, hook_timeout_seconds, ld_so_preload, profiles)",
                Some("did you mean runtime.library?"),
            ),
            (
                "[scheduler]\nslice = 5\n",
                "scheduler.slice",
                "5",
                2,
                "unknown key (accepted: policy, slice_ms,",
                Some("did you mean scheduler.slice_ms?"),
            ),
            (
                "[runtme]\nlibrary = \"/x.so\"\n",
                "runtme",
                "",
                1,
                "unknown key (accepted: arbiter, requests, runtime, scheduler, kubernetes, placement, memory)",
                Some("did you mean [runtime]?"),
            ),
            (
                "\n[scheduler]\npolicy = \"round_robin\"\n",
                "scheduler.policy",
                "\"round_robin\"",
                3,
                "unknown value (accepted: priority, round-robin, off)",
                Some("did you mean \"round-robin\"?"),
            ),
            (
                "[requests]\naccept_env = \"yes\"\n",
                "requests.accept_env",
                "\"yes\"",
                2,
                "invalid type: string \"yes\", expected a boolean",
                None,
            ),
            (
                "[arbiter]\ndefault_memory = \"4GB\"\n",
                "arbiter.default_memory",
                "\"4GB\"",
                2,
                "invalid memory amount \"4GB\"",
                Some("the unit reads two ways: did you mean \"4Gi\" (4294967296 bytes) or \"4G\" (4000000000 bytes)?"),
            ),
            (
                "[arbiter]\ndefault_memory = 4\n",
                "arbiter.default_memory",
                "4",
                2,
                "invalid type: integer `4`, expected a string",
                Some("did you mean \"4Gi\"?"),
            ),
            (
                "[arbiter]\ncontext_memory_estimate = \"300 Mi\"\n",
                "arbiter.context_memory_estimate",
                "\"300 Mi\"",
                2,
                "invalid size \"300 Mi\"",
                Some("did you mean \"300Mi\"?"),
            ),
            (
                "[[arbiter.devices]]\nuuid = \"GPU-1\"\nmemory = \"16g\"\n",
                "arbiter.devices[0].memory",
                "\"16g\"",
                3,
                "invalid size \"16g\"",
                Some("did you mean \"16Gi\" (17179869184 bytes) or \"16G\" (16000000000 bytes)?"),
            ),
            (
                "[kubernetes]\nmemory_unit = 1\n",
                "kubernetes.memory_unit",
                "1",
                2,
                "must be at least 1 MiB",
                Some("did you mean \"1Gi\"?"),
            ),
            (
                "[scheduler]\nrevoke_grace_ms = 0\n",
                "scheduler.revoke_grace_ms",
                "0",
                2,
                "must be at least 1 and at most 3600000 (1 h)",
                None,
            ),
            (
                "[runtime]\nlibrary = \"lib.so\"\n",
                "runtime.library",
                "\"lib.so\"",
                2,
                "must be an absolute path",
                None,
            ),
        ] {
            let found = problems(text);
            assert_eq!(found.len(), 1, "{text:?}: {found:?}");
            let p = &found[0];
            assert_eq!(p.key.as_deref(), Some(key), "{text:?}");
            assert_eq!(p.value.as_deref().unwrap_or(""), value, "{text:?}");
            assert_eq!(p.line, Some(line), "{text:?}");
            assert!(p.message.contains(message), "{text:?}: {}", p.message);
            match (hint, &p.hint) {
                (Some(expected), Some(given)) => {
                    assert!(given.contains(expected), "{text:?}: {given}")
                }
                (None, None) => {}
                (expected, given) => panic!("{text:?}: hint {given:?}, expected {expected:?}"),
            }
        }
    }

    #[test]
    fn every_unknown_key_and_wrong_type_of_a_file_is_listed_in_order() {
        let text = "[runtime]\nlibary = \"/x.so\"\nhook = 5\n\n[scheduler]\nslice = 5\npolicy = \"fifo\"\n\
                    [[arbiter.devices]]\nuuid = \"GPU-1\"\nmemory = \"lots\"\n";
        let keys: Vec<(String, Option<usize>)> = problems(text)
            .into_iter()
            .map(|p| (p.key.unwrap(), p.line))
            .collect();
        // In the file's order; the device's missing memory, once its wrong value is
        // taken out, is not a second problem.
        assert_eq!(
            keys,
            [
                ("runtime.libary".to_string(), Some(2)),
                ("runtime.hook".into(), Some(3)),
                ("scheduler.slice".into(), Some(6)),
                ("scheduler.policy".into(), Some(7)),
                ("arbiter.devices[0].memory".into(), Some(10)),
            ]
        );
    }

    #[test]
    fn every_semantic_problem_is_listed_once_the_file_is_well_typed() {
        let text = "[runtime]\nlibrary = \"lib.so\"\nhook_timeout_seconds = 0\n[arbiter]\nlow_nums_limit = 0\n";
        let found: Vec<String> = problems(text).iter().map(Problem::to_string).collect();
        assert_eq!(
            found,
            [
                "line 2: runtime.library = \"lib.so\": must be an absolute path",
                "line 3: runtime.hook_timeout_seconds = 0: must be at least 1 (runc would otherwise wait forever)",
                "line 5: arbiter.low_nums_limit = 0: must be at least 1 (0 would refuse every low-priority request)",
            ]
        );
    }

    #[test]
    fn a_syntax_error_is_one_problem_with_its_line() {
        let found = problems("[runtime]\nlibrary = /usr/lib/x.so\n");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].key, None);
        assert_eq!(found[0].line, Some(2));
        assert!(
            found[0].message.starts_with("not valid TOML: "),
            "{}",
            found[0]
        );
    }

    #[test]
    fn a_flood_of_unknown_keys_stops_at_the_bound() {
        let text: String = (0..50).map(|i| format!("unknown_{i} = 1\n")).collect();
        assert_eq!(problems(&text).len(), MAX_PROBLEMS);
    }

    #[test]
    fn nearest_takes_a_dropped_unit_or_a_small_slip_and_nothing_far() {
        let accepted: Vec<String> = ["slice_ms", "min_slice_ms", "policy", "window_ms", "hook"]
            .map(String::from)
            .to_vec();
        for (name, expected) in [
            ("slice", Some("slice_ms")),
            ("window", Some("window_ms")),
            ("polcy", Some("policy")),
            ("POLICY", Some("policy")),
            ("slcie_ms", Some("slice_ms")),
            ("hok", Some("hook")),
            ("nothing_alike", None),
            ("x", None),
        ] {
            assert_eq!(nearest(name, &accepted), expected, "{name}");
        }
    }

    #[test]
    fn doubts_are_memory_sizes_written_as_small_bare_numbers() {
        let text = "[arbiter]\ncontext_memory_estimate = 300\n\n[[arbiter.devices]]\nuuid = \"GPU-1\"\nmemory = \"16\"\n\
                    [[arbiter.devices]]\nuuid = \"GPU-2\"\nmemory = 17179869184\n[kubernetes]\nmemory_unit = \"1Gi\"\n\
                    [scheduler]\nslice_ms = 16\n";
        let found: Vec<String> = doubts(text).iter().map(Problem::to_string).collect();
        assert_eq!(
            found,
            [
                "line 2: arbiter.context_memory_estimate = 300: read as 300 bytes; did you mean \"300Gi\"? a size is a string with its unit (\"512Mi\", \"300Gi\")",
                "line 6: arbiter.devices[0].memory = \"16\": read as 16 bytes; did you mean \"16Gi\"? a size is a string with its unit (\"512Mi\", \"16Gi\")",
            ]
        );
        // 0 (no estimate), sizes with units and large byte counts are no slip.
        assert!(doubts("[arbiter]\ncontext_memory_estimate = 0\n").is_empty());
        assert!(doubts("[arbiter]\ndefault_memory = \"4Gi\"\n").is_empty());
        assert!(doubts("not toml = =").is_empty());
    }

    #[test]
    fn memory_hints_spell_what_was_meant() {
        let key = |k: &str| vec![Step::Key("arbiter".into()), Step::Key(k.into())];
        for (k, written, expected) in [
            (
                "default_memory",
                "\"4g\"",
                Some("\"4Gi\" (4294967296 bytes) or \"4G\" (4000000000 bytes)"),
            ),
            ("default_memory", "\"4 Gi\"", Some("did you mean \"4Gi\"?")),
            ("default_memory", "\"40 %\"", Some("did you mean \"40%\"?")),
            ("default_memory", "8", Some("did you mean \"8Gi\"?")),
            ("default_memory", "\"lots\"", None),
            ("client_timeout_ms", "\"4g\"", None),
        ] {
            let hint = memory_hint(&key(k), Some(written));
            match expected {
                Some(e) => assert!(
                    hint.as_deref().is_some_and(|h| h.contains(e)),
                    "{written}: {hint:?}"
                ),
                None => assert_eq!(hint, None, "{written}"),
            }
        }
    }
}
