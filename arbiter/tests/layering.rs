//! The daemon's modules import one another without a circle, and so do those of the
//! crates around it (the protocol, the configuration, gpusharectl, admission, the shim,
//! the device plugin; the interposer has its own, stricter, ranked check): every
//! `crate::…` path in a top-level module's source (its folder included; unit tests
//! excluded: a test may reach anywhere) is an arrow to another top-level module, and the
//! arrows form no cycle. A circle means two modules that can only be understood,
//! changed or tested together — one of them holds something that belongs in a third,
//! lower one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        // Programs (src/bin) are not part of the library.
        if path.ends_with("bin") {
            continue;
        }
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("tests.rs") {
            out.push(path);
        }
    }
}

/// The top-level module a source file belongs to (`state/handle.rs` is `state`).
fn module_of(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).unwrap();
    let first = relative.components().next().unwrap().as_os_str();
    first.to_string_lossy().trim_end_matches(".rs").to_owned()
}

/// The modules a source names as `crate::<module>`, up to its unit tests.
fn imports(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or(text);
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // `crate::{a, b}` names several.
        if name.is_empty() && rest.starts_with('{') {
            let group = &rest[1..rest.find('}').unwrap_or(rest.len())];
            for part in group.split(',') {
                let part: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !part.is_empty() {
                    found.insert(part);
                }
            }
        } else if !name.is_empty() {
            found.insert(name);
        }
    }
    found
}

/// One cycle through `start`, if the arrows have one.
fn cycle_from(
    arrows: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    path: &mut Vec<String>,
) -> Option<Vec<String>> {
    for next in arrows.get(path.last().unwrap()).into_iter().flatten() {
        if next == start {
            let mut cycle = path.clone();
            cycle.push(start.to_owned());
            return Some(cycle);
        }
        if !path.contains(next) {
            path.push(next.clone());
            if let Some(cycle) = cycle_from(arrows, start, path) {
                return Some(cycle);
            }
            path.pop();
        }
    }
    None
}

/// The crates checked, by their directory beside this one.
const CRATES: [&str; 7] = [
    "arbiter", "proto", "config", "ctl", "oci-hook", "shim", "kube",
];

#[test]
fn modules_import_one_another_without_a_circle() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let circles: Vec<String> = CRATES
        .iter()
        .flat_map(|name| {
            circles_in(&workspace.join(name).join("src"))
                .into_iter()
                .map(move |circle| format!("{name}: {circle}"))
        })
        .collect();
    assert!(
        circles.is_empty(),
        "import circles between modules:\n{}",
        circles.join("\n")
    );
}

fn circles_in(src: &Path) -> BTreeSet<String> {
    let src = src.to_owned();
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut arrows: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        if module == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap();
        for target in imports(&text) {
            let is_module = src.join(&target).is_dir() || src.join(format!("{target}.rs")).exists();
            if target != module && is_module {
                arrows.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    let mut circles = BTreeSet::new();
    for module in arrows.keys() {
        if let Some(mut cycle) = cycle_from(&arrows, module, &mut vec![module.clone()]) {
            // One line per circle, however it is entered.
            cycle.pop();
            let at = cycle.iter().enumerate().min_by_key(|(_, m)| *m).unwrap().0;
            cycle.rotate_left(at);
            circles.insert(cycle.join(" → "));
        }
    }
    circles
}
