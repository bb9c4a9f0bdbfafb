//! The name docker or podman gave a container, for people reading status, `top` and
//! metrics. Neither engine puts it in the OCI spec it hands the runtime (docker 20.10
//! and podman 4.3, measured: no name annotation, `hostname` is the id's first 12
//! characters), so it is read from what each engine keeps outside the container.
//!
//! Docker: the name lives in the engine's own record,
//! `<data-root>/containers/<id>/config.v2.json` (`"Name": "/my-trainer"`), and the
//! container's `/etc/hostname` is a bind mount of a file in that very directory,
//! whatever `--data-root` is. So from the confirmed init pid: its mount table names
//! the directory (relative to its file system), the host's mount table names where
//! that file system is mounted, and the record beside it names the container.
//!
//! Podman: the name is in its database, but every container has a `conmon` monitor,
//! started with `-c <id>` and `-n <name>`, and conmon is the init's parent (its
//! grandparent while `runc create` still runs, when the hooks confirm it). A host
//! process the container cannot change, so its arguments are as good as the engine's.
//!
//! Anything that does not fit (another engine, another layout, a record or a monitor
//! that does not name this id) gives no name, and the id is shown instead.

use procfs_core::process::{MountInfo, Status};
use procfs_core::FromRead;
use std::path::{Path, PathBuf};

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
/// procfs-core 0.18 hands `root` and `mount_point` over as the kernel wrote them,
/// escapes and all, so a data root with a space in it would not match otherwise.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        // The kernel escapes only space, tab, newline and backslash (\040 … \134);
        // anything above \377 is no escape of its and is kept as written.
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)))
            .and_then(|d| {
                let value = d.iter().fold(0u32, |v, b| v * 8 + u32::from(b - b'0'));
                u8::try_from(value).ok()
            });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One mountinfo line: (device `major:minor`, root within its file system, mount point);
/// None for a line procfs-core cannot read, which is skipped rather than spoiling the
/// rest of the table.
fn parse_line(line: &str) -> Option<(String, String, String)> {
    let mount = MountInfo::from_line(line).ok()?;
    let mount_point = unescape(mount.mount_point.to_str()?);
    Some((mount.majmin, unescape(&mount.root), mount_point))
}

/// Where container `container_id`'s `/etc/hostname` comes from: its device and path
/// on it. The arbiter looks when the createRuntime hook confirms the container, and
/// runc runs that hook after it mounts the container's files but before pivot_root
/// (runc's prepareRootfs), so the mount point is still `<rootfs>/etc/hostname`, and
/// the mount namespace still holds the host's mounts, among them perhaps a
/// `/etc/hostname` of the host's own engine: only a mount of a file named
/// `hostname` in a directory named after this container counts.
pub fn hostname_source(container_mountinfo: &str, container_id: &str) -> Option<(String, String)> {
    let own_file = format!("/{container_id}/hostname");
    container_mountinfo
        .lines()
        .filter_map(parse_line)
        .find(|(_, root, mount_point)| {
            (mount_point == "/etc/hostname" || mount_point.ends_with("/etc/hostname"))
                && root.ends_with(&own_file)
        })
        .map(|(device, root, _)| (device, root))
}

/// The host path of `root` on `device`: through the host mount of that device whose
/// root is the longest prefix of it.
pub fn host_path(host_mountinfo: &str, device: &str, root: &str) -> Option<PathBuf> {
    host_mountinfo
        .lines()
        .filter_map(parse_line)
        .filter(|(d, _, _)| d == device)
        .filter_map(|(_, mount_root, mount_point)| {
            let rest = Path::new(root).strip_prefix(&mount_root).ok()?;
            Some((mount_root.len(), Path::new(&mount_point).join(rest)))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, path)| path)
}

/// The `Name` of docker's `config.v2.json`, without docker's leading '/', provided
/// the record's `ID` is `container_id`.
pub fn name_in_record(config_v2: &str, container_id: &str) -> Option<String> {
    let record: serde_json::Value = serde_json::from_str(config_v2).ok()?;
    if record.get("ID")?.as_str()? != container_id {
        return None;
    }
    let name = record.get("Name")?.as_str()?.trim_start_matches('/');
    (!name.is_empty()).then(|| name.to_owned())
}

/// The docker name of the container whose init is `pid` and id `container_id`;
/// None for anything that is not a docker container laid out as described above.
pub fn docker_name(pid: u32, container_id: &str) -> Option<String> {
    if container_id.len() != 64 || !container_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let theirs = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).ok()?;
    let (device, root) = hostname_source(&theirs, container_id)?;
    let ours = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let hostname = host_path(&ours, &device, &root)?;
    let directory = hostname.parent()?;
    if directory.file_name()?.to_str()? != container_id {
        return None;
    }
    let record = std::fs::read_to_string(directory.join("config.v2.json")).ok()?;
    name_in_record(&record, container_id)
}

/// The name in a conmon command line (`args`, program first), provided its
/// container (`-c`/`--cid`) is `container_id`.
pub fn name_in_conmon_args(args: &[&str], container_id: &str) -> Option<String> {
    let value_of = |short: &str, long: &str| {
        args.iter().enumerate().find_map(|(i, arg)| {
            let long_eq = format!("{long}=");
            if *arg == short || *arg == long {
                args.get(i + 1).copied()
            } else {
                arg.strip_prefix(long_eq.as_str())
            }
        })
    };
    if value_of("-c", "--cid")? != container_id {
        return None;
    }
    let name = value_of("-n", "--name")?;
    (!name.is_empty()).then(|| name.to_owned())
}

/// The parent of `pid`, from `/proc/<pid>/status` (`PPid:`), whose layout a process
/// name with spaces or parentheses cannot confuse, unlike `stat`'s.
fn parent_of(pid: u32) -> Option<u32> {
    parent_in_status(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// The `PPid` of a `/proc/<pid>/status` text, unless it is init (1) or none (0).
fn parent_in_status(status: &str) -> Option<u32> {
    let status = Status::from_read(status.as_bytes()).ok()?;
    u32::try_from(status.ppid).ok().filter(|&p| p > 1)
}

/// The podman name of the container whose init is `pid` and id `container_id`, from
/// its conmon (the nearest ancestor of that name, within a few generations).
pub fn podman_name(pid: u32, container_id: &str) -> Option<String> {
    let mut ancestor = parent_of(pid)?;
    // conmon → runc create → runc init while the hooks run; conmon → init after.
    for _ in 0..3 {
        let comm = std::fs::read_to_string(format!("/proc/{ancestor}/comm")).ok()?;
        if comm.trim_end() == "conmon" {
            let cmdline = std::fs::read(format!("/proc/{ancestor}/cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline);
            let args: Vec<&str> = cmdline.split('\0').collect();
            return name_in_conmon_args(&args, container_id);
        }
        ancestor = parent_of(ancestor)?;
    }
    None
}

/// The name the container's engine gave it: docker's, else podman's.
pub fn engine_name(pid: u32, container_id: &str) -> Option<String> {
    docker_name(pid, container_id).or_else(|| podman_name(pid, container_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "ed5040c8f52e343e4a33f14778bb2da76c959e004c27408fb82604f4aab3cc3e";

    /// A docker 20.10 container's mountinfo lines (`--data-root /tmp/h3docker/root`).
    fn container_mountinfo(root_prefix: &str) -> String {
        format!(
            "74 60 0:52 / / rw,relatime - overlay overlay rw\n\
             91 74 254:0 {root_prefix}/containers/{ID}/resolv.conf /etc/resolv.conf rw,relatime - ext4 /dev/vda rw\n\
             92 74 254:0 {root_prefix}/containers/{ID}/hostname /etc/hostname rw,relatime - ext4 /dev/vda rw\n"
        )
    }

    #[test]
    fn the_hostname_mount_leads_to_the_engines_directory() {
        let host_root_fs = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n";
        // Data root on its own file system, mounted at /var/lib/docker (a common layout).
        let host_own_fs = "27 1 254:1 / / rw - ext4 /dev/vda rw\n30 27 254:0 / /var/lib/docker rw - ext4 /dev/vdb rw\n";
        for (container, host, want) in [
            (
                container_mountinfo("/tmp/h3docker/root"),
                host_root_fs,
                Some(format!("/tmp/h3docker/root/containers/{ID}/hostname")),
            ),
            (
                container_mountinfo(""),
                host_own_fs,
                Some(format!("/var/lib/docker/containers/{ID}/hostname")),
            ),
            // The device is mounted nowhere here (another mount namespace): no path.
            (
                container_mountinfo(""),
                "27 1 254:9 / / rw - ext4 x rw\n",
                None,
            ),
        ] {
            let (device, root) = hostname_source(&container, ID).unwrap();
            assert_eq!(
                host_path(host, &device, &root),
                want.map(PathBuf::from),
                "{container}"
            );
        }
        // No /etc/hostname mount (not an engine's container): nothing.
        assert_eq!(
            hostname_source("74 60 0:52 / / rw - overlay overlay rw\n", ID),
            None
        );
        // Escaped spaces in a data root.
        let spaced = container_mountinfo("/srv/my\\040docker");
        assert_eq!(
            hostname_source(&spaced, ID).unwrap().1,
            format!("/srv/my docker/containers/{ID}/hostname")
        );
    }

    /// What the createRuntime hook's moment looks like (docker 20.10 through
    /// gpushare-runc, measured in tests/e2e/tests/docker.rs): runc has mounted the
    /// container's files under its rootfs but not pivoted yet, and the namespace
    /// still lists the host's mounts, here a host that is itself a container with
    /// its own engine-made `/etc/hostname`.
    #[test]
    fn before_pivot_root_the_mount_under_the_rootfs_is_the_containers() {
        let data_root = "/tmp/gs-e2e/docker-root";
        let rootfs = format!("{data_root}/vfs/dir/{ID}");
        let other = "0".repeat(64);
        let mountinfo = format!(
            "27 1 254:0 / / rw - ext4 /dev/vda rw\n\
             28 27 254:0 /var/lib/docker/containers/{other}/hostname /etc/hostname rw - ext4 /dev/vda rw\n\
             95 27 254:0 {data_root}/containers/{ID}/hostname {rootfs}/etc/hostname rw - ext4 /dev/vda rw\n"
        );
        assert_eq!(
            hostname_source(&mountinfo, ID),
            Some((
                "254:0".to_owned(),
                format!("{data_root}/containers/{ID}/hostname")
            ))
        );
        // The host's own hostname mount names another container: never taken.
        assert_eq!(hostname_source(&mountinfo, &"1".repeat(64)), None);
        // A file named hostname in a directory not named after the container.
        let elsewhere = format!("95 27 254:0 /srv/hostname {rootfs}/etc/hostname rw - ext4 x rw\n");
        assert_eq!(hostname_source(&elsewhere, ID), None);
    }

    #[test]
    fn octal_escapes_and_what_is_not_one() {
        assert_eq!(unescape("/a\\040b\\011c\\012d\\134e"), "/a b\tc\nd\\e");
        // Above \377, too short, or not octal: kept as written (and never a panic).
        for kept in ["/a\\777", "/a\\04", "/a\\089", "/a\\"] {
            assert_eq!(unescape(kept), kept);
        }
    }

    #[test]
    fn escaped_and_unreadable_mountinfo_lines() {
        // procfs-core leaves `\040` (space) and `\134` (backslash) escaped in the mount
        // point too: a rootfs under such a path still ends in /etc/hostname. A line
        // procfs-core cannot read (cut short, or a mount id that is no number) is
        // skipped; the lines around it still count.
        let junk = "27 1 254:0 / / rw\nx 1 254:0 / / rw - ext4 x rw\n";
        let escaped_rootfs = format!(
            "95 27 254:0 /d/containers/{ID}/hostname /srv/a\\040b\\134c/rootfs/etc/hostname rw - ext4 x rw\n"
        );
        for (mountinfo, root) in [
            (escaped_rootfs, format!("/d/containers/{ID}/hostname")),
            (
                format!("{junk}{}", container_mountinfo("/r")),
                format!("/r/containers/{ID}/hostname"),
            ),
        ] {
            assert_eq!(
                hostname_source(&mountinfo, ID),
                Some(("254:0".into(), root)),
                "{mountinfo}"
            );
        }
        for (host, want) in [
            (
                "30 27 254:0 /d /srv/my\\040data rw - ext4 x rw\n",
                Some(PathBuf::from("/srv/my data/containers/x/hostname")),
            ),
            (junk, None),
        ] {
            assert_eq!(
                host_path(host, "254:0", "/d/containers/x/hostname"),
                want,
                "{host}"
            );
        }
    }

    /// A `/proc/<pid>/status` as Linux 5.15 writes it, with `name` and `PPid` put in.
    fn status_text(name: &str, ppid: &str) -> String {
        format!(
            "Name:\t{name}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t2835\nNgid:\t0\n\
             Pid:\t2835\nPPid:\t{ppid}\nTracerPid:\t0\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n\
             FDSize:\t256\nGroups:\t \nNStgid:\t2835\nNSpid:\t2835\nVmPeak:\t    3060 kB\n\
             VmRSS:\t    1768 kB\nThreads:\t1\nSigQ:\t0/96365\nSigPnd:\t0000000000000000\n\
             ShdPnd:\t0000000000000000\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n\
             SigCgt:\t0000000000000000\nCapInh:\t0000000000000000\nCapPrm:\t000001fffeffffff\n\
             CapEff:\t000001fffeffffff\nCapBnd:\t000001fffeffffff\nCapAmb:\t0000000000000000\n\
             NoNewPrivs:\t0\nSeccomp:\t0\nCpus_allowed:\t3\nCpus_allowed_list:\t0-1\n\
             voluntary_ctxt_switches:\t0\nnonvoluntary_ctxt_switches:\t0\n"
        )
    }

    #[test]
    fn the_parent_comes_from_status() {
        for (name, ppid, want) in [
            ("conmon", "2833", Some(2833)),
            // A name with a colon and parentheses in it.
            ("a: (b) c", "77", Some(77)),
            // init and the kernel's own are nobody's conmon.
            ("x", "1", None),
            ("x", "0", None),
            ("x", "many", None),
        ] {
            let status = status_text(name, ppid);
            assert_eq!(parent_in_status(&status), want, "{status}");
        }
        let no_ppid = status_text("x", "5").replace("PPid:\t5\n", "");
        assert_eq!(parent_in_status(&no_ppid), None);
        assert_eq!(
            parent_of(std::process::id()),
            Some(std::os::unix::process::parent_id()).filter(|&p| p > 1),
            "this test process's own parent"
        );
    }

    #[test]
    fn conmon_names_the_container_only_if_it_monitors_this_one() {
        // podman 4.3's conmon, abridged.
        let args = [
            "/usr/bin/conmon",
            "--api-version",
            "1",
            "-c",
            ID,
            "-u",
            ID,
            "-r",
            "/usr/bin/runc",
            "-b",
            "/tmp/x/userdata",
            "-n",
            "trainer-7",
            "--exit-dir",
            "/run/exits",
        ];
        assert_eq!(name_in_conmon_args(&args, ID), Some("trainer-7".into()));
        assert_eq!(name_in_conmon_args(&args, &"0".repeat(64)), None);
        let long = ["conmon", &format!("--cid={ID}"), "--name=job a"];
        assert_eq!(name_in_conmon_args(&long, ID), Some("job a".into()));
        let spaced = ["conmon", "--cid", ID, "--name", "b"];
        assert_eq!(name_in_conmon_args(&spaced, ID), Some("b".into()));
        // No container named, no name, an empty name, or "-n" last: nothing.
        assert_eq!(name_in_conmon_args(&["conmon", "-n", "x"], ID), None);
        assert_eq!(name_in_conmon_args(&["conmon", "-c", ID], ID), None);
        assert_eq!(
            name_in_conmon_args(&["conmon", "-c", ID, "-n", ""], ID),
            None
        );
        assert_eq!(name_in_conmon_args(&["conmon", "-c", ID, "-n"], ID), None);
        // This test's own process has no conmon above it.
        assert_eq!(podman_name(std::process::id(), ID), None);
    }

    #[test]
    fn the_record_names_the_container_only_if_it_is_this_one() {
        let record = format!(r#"{{"ID":"{ID}","Name":"/my-trainer","Config":{{}}}}"#);
        assert_eq!(name_in_record(&record, ID), Some("my-trainer".into()));
        assert_eq!(name_in_record(&record, &"0".repeat(64)), None);
        assert_eq!(name_in_record(r#"{"ID":"x","Name":"/"}"#, "x"), None);
        assert_eq!(name_in_record("not json", ID), None);
        // Not a docker id: not even looked up.
        assert_eq!(docker_name(std::process::id(), "trainer-1"), None);
    }
}
