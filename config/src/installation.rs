//! What `check-config` checks beyond the file itself: that the files its host-side
//! paths name are on this machine. A configuration that reads well but names a library
//! or hook that is not there makes every sharing container fail at create time
//! (`error mounting ".../libgpushare.so"`), far from the file that caused it.

use std::path::Path;

use crate::{Config, Problem};

/// What the check asks of the machine.
pub trait Machine {
    fn is_file(&self, path: &Path) -> bool;
    fn is_executable(&self, path: &Path) -> bool;
    /// Whether a runtime named this way is found: an absolute path that is an
    /// executable file, or a name on `PATH`.
    fn finds(&self, program: &str) -> bool;
}

/// The machine this runs on.
pub struct ThisMachine;

impl Machine for ThisMachine {
    fn is_file(&self, path: &Path) -> bool {
        path.is_file()
    }

    fn is_executable(&self, path: &Path) -> bool {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    }

    fn finds(&self, program: &str) -> bool {
        if program.contains('/') {
            return self.is_executable(Path::new(program));
        }
        std::env::var_os("PATH").is_some_and(|path| {
            std::env::split_paths(&path).any(|dir| self.is_executable(&dir.join(program)))
        })
    }
}

/// The host-side paths of `config` that `machine` does not have, one problem each.
pub fn problems(config: &Config, machine: &dyn Machine) -> Vec<Problem> {
    let runtime = &config.runtime;
    let mut found = Vec::new();
    if !machine.is_file(&runtime.library) {
        found.push(Problem::at(
            "runtime.library",
            runtime.library.display(),
            "no such file on this machine: gpushare-runc and the shim mount this library into \
             every sharing container; install it there (make install, the package) or name \
             where it is",
        ));
    }
    if !machine.is_executable(&runtime.hook) {
        found.push(Problem::at(
            "runtime.hook",
            runtime.hook.display(),
            "no executable file there on this machine: every sharing container's spec runs it \
             as a hook; install gpushare-hook there or name where it is",
        ));
    }
    if !runtime.runtimes.iter().any(|r| machine.finds(r)) {
        found.push(Problem::at(
            "runtime.runtimes",
            format!("{:?}", runtime.runtimes),
            "none of these is on PATH (or an executable at the path given): gpushare-runc hands \
             each container to the first one found; install one (runc) or name one that is here",
        ));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    struct Having(Vec<&'static str>);

    impl Machine for Having {
        fn is_file(&self, path: &Path) -> bool {
            self.0.contains(&path.to_str().unwrap())
        }
        fn is_executable(&self, path: &Path) -> bool {
            self.is_file(path)
        }
        fn finds(&self, program: &str) -> bool {
            self.0.contains(&program)
        }
    }

    fn config() -> Config {
        let mut config = Config::default();
        config.runtime.library = PathBuf::from("/usr/lib/gpushare/libgpushare.so");
        config.runtime.hook = PathBuf::from("/usr/bin/gpushare-hook");
        config.runtime.runtimes = vec!["nvidia-container-runtime".into(), "runc".into()];
        config
    }

    #[test]
    fn each_missing_path_is_named_with_its_key_and_value() {
        const LIB: &str = "/usr/lib/gpushare/libgpushare.so";
        const HOOK: &str = "/usr/bin/gpushare-hook";
        let cases: &[(&str, Vec<&'static str>, &[&str])] = &[
            ("everything there", vec![LIB, HOOK, "runc"], &[]),
            (
                "the NVIDIA runtime alone",
                vec![LIB, HOOK, "nvidia-container-runtime"],
                &[],
            ),
            ("no library", vec![HOOK, "runc"], &["runtime.library"]),
            ("no hook", vec![LIB, "runc"], &["runtime.hook"]),
            ("no runtime", vec![LIB, HOOK], &["runtime.runtimes"]),
            (
                "nothing installed",
                vec![],
                &["runtime.library", "runtime.hook", "runtime.runtimes"],
            ),
        ];
        for (name, having, expected) in cases {
            let found = problems(&config(), &Having(having.clone()));
            let keys: Vec<&str> = found.iter().filter_map(|p| p.key.as_deref()).collect();
            assert_eq!(&keys, expected, "{name}");
            for problem in &found {
                let text = problem.describe();
                assert!(text.contains(" = "), "the value is named: {text}");
            }
        }
        let found = problems(&config(), &Having(vec![HOOK, "runc"]));
        assert!(found[0]
            .describe()
            .starts_with(&format!("runtime.library = {LIB}: no such file")));
    }

    #[test]
    fn a_runtime_by_absolute_path_must_be_executable_there() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("my-runc");
        std::fs::write(&script, "#!/bin/sh\n").unwrap();
        let path = script.to_str().unwrap().to_owned();
        assert!(!ThisMachine.finds(&path), "not executable yet");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(ThisMachine.finds(&path));
        assert!(ThisMachine.finds("sh"), "a name on PATH");
        assert!(!ThisMachine.finds("no-such-runtime-anywhere"));
    }
}
