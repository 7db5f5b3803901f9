//! An ext4 filesystem on an mdkit export, through nbdfuse and a loop device: mkfs, mount,
//! write files, unmount, fsck clean, remount, contents intact. Needs root, /dev/fuse and loop
//! devices.

use crate::common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Server, is_root, pattern, require_tool, run};

/// Cleans up mounts, loop devices and nbdfuse even when the test fails half-way.
struct Cleanup {
    mnt: std::path::PathBuf,
    fuse_dir: std::path::PathBuf,
    loop_dev: Option<String>,
    nbdfuse: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).stderr(Stdio::null()).status();
        if let Some(l) = &self.loop_dev {
            let _ = Command::new("losetup").args(["-d", l]).status();
        }
        // Lazily: the loop device lets go of the file only after its detach completes (a plain
        // unmount failed "busy" and left the mount behind once nbdfuse was killed).
        let _ = Command::new("fusermount3").args(["-u", "-z"]).arg(&self.fuse_dir).stderr(Stdio::null()).status();
        if let Some(mut c) = self.nbdfuse.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn write_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    for i in 0..24u64 {
        let len = match i % 4 {
            0 => 1,
            1 => 4095,
            2 => 65_537,
            _ => 1_500_000 + i as usize * 1000,
        };
        let name = format!("f{i:02}.bin");
        let data = pattern(1000 + i, len);
        std::fs::write(dir.join(&name), &data).unwrap();
        files.push((name, data));
    }
    files
}

#[test]
fn ext4_through_nbdfuse_and_loop_survives_fsck_and_remount() {
    if !is_root() || !Path::new("/dev/fuse").exists() {
        eprintln!("SKIP: ext4 over nbdfuse needs root and /dev/fuse");
        return;
    }
    for (tool, pkg) in [
        ("nbdfuse", "libnbd-bin"),
        ("mkfs.ext4", "e2fsprogs"),
        ("e2fsck", "e2fsprogs"),
        ("losetup", "mount"),
        ("fusermount3", "fuse3"),
    ] {
        require_tool(tool, pkg);
    }
    let srv = Server::start_opts(
        "default_export = \"fs\"",
        "[[volume]]\nname = \"fsvol\"\nkind = \"file\"\npath = \"fs.img\"\nsize = \"256MiB\"\n[[export]]\nname = \"fs\"\nvolume = \"fsvol\"\n",
    );
    let fuse_dir = srv.path("fuse");
    let mnt = srv.path("mnt");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let mut cleanup = Cleanup { mnt: mnt.clone(), fuse_dir: fuse_dir.clone(), loop_dev: None, nbdfuse: None };

    // nbdfuse exposes the export as the file <dir>/nbd.
    let child = Command::new("nbdfuse").arg(&fuse_dir).arg(srv.uri("fs")).spawn().expect("spawn nbdfuse");
    cleanup.nbdfuse = Some(child);
    let nbd_file = fuse_dir.join("nbd");
    let start = Instant::now();
    while std::fs::metadata(&nbd_file).map(|m| m.len()).unwrap_or(0) != 256 << 20 {
        assert!(start.elapsed() < Duration::from_secs(20), "nbdfuse did not expose {}", nbd_file.display());
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = run(Command::new("losetup").args(["-f", "--show"]).arg(&nbd_file));
    let loop_dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    cleanup.loop_dev = Some(loop_dev.clone());

    run(Command::new("mkfs.ext4").args(["-q", "-F", &loop_dev]));
    run(Command::new("mount").arg(&loop_dev).arg(&mnt));
    let files = write_files(&mnt);
    std::fs::create_dir(mnt.join("sub")).unwrap();
    std::fs::write(mnt.join("sub/small"), b"hello mdkit").unwrap();
    run(&mut Command::new("sync"));
    run(Command::new("umount").arg(&mnt));
    // Read-only check; exit status 0 means clean.
    run(Command::new("e2fsck").args(["-fn", &loop_dev]));

    run(Command::new("mount").arg(&loop_dev).arg(&mnt));
    for (name, data) in &files {
        let got = std::fs::read(mnt.join(name)).unwrap();
        assert!(got == *data, "{name} changed after remount ({} bytes)", data.len());
    }
    assert_eq!(std::fs::read(mnt.join("sub/small")).unwrap(), b"hello mdkit");
    run(Command::new("umount").arg(&mnt));
    drop(cleanup);

    let st = srv.export_stats("fs");
    assert_eq!(st["errors"], 0, "{st}");
    assert!(st["flushes"].as_u64().unwrap() > 0, "the filesystem's flushes must reach the server: {st}");
}
