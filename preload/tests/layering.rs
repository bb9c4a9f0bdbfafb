//! The interposer's layers have no back edges: every `crate::…` path in a module's
//! source names a module of the same or a lower rank (lib.rs describes the layers).
//! A module added to the library must be placed in `RANKS` before this passes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Bottom to top. Modules in one layer are ranked too, so no two modules can import
/// each other (a cycle) even inside a layer.
const RANKS: &[(&str, &str)] = &[
    ("cuda", "ABI types"),
    ("log", "ABI types"),
    ("guard", "ABI types"),
    ("config", "ABI types"),
    ("variants", "ABI types"),
    ("loader", "dynamic loading"),
    ("symbols", "real-pointer slots"),
    ("driver", "driver calls"),
    ("gate", "accounts and gate"),
    ("watch", "accounts and gate"),
    ("lease_link", "accounts and gate"),
    ("accounts", "accounts and gate"),
    ("graph_memory", "accounts and gate"),
    ("fork", "accounts and gate"),
    ("hooks", "exported hooks"),
    ("front", "front door"),
    ("lib", "crate root"),
];

/// Macros exported at the crate root, by the module that defines them.
fn macro_home(name: &str) -> Option<&'static str> {
    match name {
        n if n.starts_with("log_") => Some("log"),
        "for_each_variant" => Some("variants"),
        _ => None,
    }
}

fn rank(module: &str) -> Option<usize> {
    RANKS.iter().position(|(m, _)| *m == module)
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        // Programs (src/bin) are not part of the library's layers.
        if path.ends_with("bin") {
            continue;
        }
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a source file belongs to (`gate/agent.rs` is `gate`).
fn module_of(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).unwrap();
    let first = relative.components().next().unwrap();
    let first = first.as_os_str().to_str().unwrap();
    first.strip_suffix(".rs").unwrap_or(first).to_string()
}

fn ident_at(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// Every module named by a `crate::` path (with `$crate::` and `crate::{a, b::c}`).
fn imports(source: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in source.lines() {
        // Comments may name paths; only code counts.
        let code = line.split("//").next().unwrap();
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let after = &rest[at + "crate::".len()..];
            if let Some(group) = after.strip_prefix('{') {
                let group = group.split('}').next().unwrap();
                for part in group.split(',') {
                    let name = ident_at(part.trim());
                    if !name.is_empty() {
                        found.insert(name);
                    }
                }
            } else {
                let name = ident_at(after);
                if !name.is_empty() {
                    found.insert(name);
                }
            }
            rest = after;
        }
    }
    found
}

/// The back edges of the library at `src`: (file, its module, the module it names).
fn back_edges(src: &Path) -> Vec<String> {
    let mut files = vec![];
    sources(src, &mut files);
    files.sort();
    let mut problems = vec![];
    for file in &files {
        let module = module_of(src, file);
        let Some(own) = rank(&module) else {
            problems.push(format!(
                "{}: module `{module}` has no place in RANKS (put it in its layer)",
                file.display()
            ));
            continue;
        };
        let source = std::fs::read_to_string(file).unwrap();
        for name in imports(&source) {
            let target = macro_home(&name).map_or(name.clone(), str::to_string);
            let Some(theirs) = rank(&target) else {
                problems.push(format!(
                    "{}: `crate::{name}` is not a module in RANKS",
                    file.display()
                ));
                continue;
            };
            if theirs > own {
                problems.push(format!(
                    "{}: back edge {module} ({}) -> {target} ({}): a layer may only use \
                     the layers below it",
                    file.display(),
                    RANKS[own].1,
                    RANKS[theirs].1
                ));
            }
        }
    }
    problems
}

#[test]
fn every_import_points_to_the_same_or_a_lower_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let problems = back_edges(&src);
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn a_back_edge_is_found() {
    // The checker itself, on a made-up library: the driver layer reaching up into the
    // hooks, through a grouped import.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cuda.rs"), "pub type Handle = usize;\n").unwrap();
    std::fs::write(
        dir.path().join("driver.rs"),
        "use crate::{cuda::Handle, hooks};\n// crate::front in a comment does not count\n",
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("hooks")).unwrap();
    std::fs::write(
        dir.path().join("hooks/mod.rs"),
        "fn f() { crate::log_info!(\"x\"); $crate::driver::g(); }\n",
    )
    .unwrap();
    let problems = back_edges(dir.path());
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("back edge driver (driver calls) -> hooks (exported hooks)"),
        "{problems:?}"
    );
}
