//! A container root filesystem without a registry: the host's busybox-static and a link
//! per applet.

use std::path::Path;
use std::process::Command;

/// The host's statically linked busybox (Debian's busybox-static, which `make test` installs).
pub const BUSYBOX: &str = "/bin/busybox";

/// Builds a root filesystem at `dir`: busybox and its applets in /bin, the usual mount
/// points, and a passwd and group naming root and nobody.
pub fn busybox_rootfs(dir: &Path) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for d in ["proc", "sys", "dev", "etc", "tmp", "run"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::copy(BUSYBOX, bin.join("busybox"))
        .expect("busybox-static installed (make test installs it)");
    let list = Command::new(BUSYBOX)
        .arg("--list")
        .output()
        .expect("busybox --list");
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            let _ = std::os::unix::fs::symlink("busybox", bin.join(applet));
        }
    }
    std::fs::write(
        dir.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(dir.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n").unwrap();
}
