//! Loop devices: a loop device stores its data in its backing file, so the two are one device
//! (for the in-use rule above and for [`crate::lock`]).

use std::path::PathBuf;

/// The backing file of the block device numbered `rdev` (`st_rdev`) when it is a loop device;
/// `None` for any other block device, or when the backing file was deleted.
pub fn loop_backing_file(rdev: u64) -> Option<PathBuf> {
    let (major, minor) = (major(rdev), minor(rdev));
    let backing = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/loop/backing_file")).ok()?;
    let file = backing.trim_end();
    (!file.ends_with(" (deleted)")).then(|| PathBuf::from(file))
}

/// glibc's `major()` of a `dev_t` (its bits are split across the word).
pub fn major(dev: u64) -> u64 {
    ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0000_0fff)
}

/// glibc's `minor()` of a `dev_t`.
pub fn minor(dev: u64) -> u64 {
    ((dev >> 12) & 0xffff_ff00) | (dev & 0x0000_00ff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn major_and_minor_split_like_glibc() {
        // makedev(7, 3) and makedev(259, 1048577).
        assert_eq!((major(0x703), minor(0x703)), (7, 3));
        let dev = (259u64 & 0xfff) << 8 | (1048577u64 & 0xff) | (1048577u64 & !0xff) << 12;
        assert_eq!((major(dev), minor(dev)), (259, 1048577));
    }
}
