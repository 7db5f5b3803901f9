//! What `mdkit examine` reads a member through: a file or block device, or an export on an NBD
//! server (`nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`, the remote member
//! specs the service takes), read with mdkit's own NBD client.

use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result};
use mdkit_io::{BlockDevice, IoBuf, NbdClientOptions, NbdDevice, is_nbd_uri};

/// A member opened read-only for examining.
pub enum MemberReader {
    File(std::fs::File),
    /// The client runs on its own runtime, driven by each read.
    Remote {
        dev: NbdDevice,
        rt: tokio::runtime::Runtime,
    },
}

/// Reads larger than this go in pieces (a bad-block log is at most a few KiB).
const REMOTE_READ_MAX_BYTES: usize = 1 << 20;

impl MemberReader {
    /// Opens `spec`: an NBD URI, else a path.
    pub fn open(spec: &Path) -> Result<MemberReader> {
        match spec.to_str().filter(|s| is_nbd_uri(s)) {
            Some(uri) => open_remote(uri),
            None => {
                let f = std::fs::File::open(spec).with_context(|| format!("opening {}", spec.display()))?;
                Ok(MemberReader::File(f))
            }
        }
    }

    /// The member's size in 512-byte sectors.
    pub fn sectors(&self, spec: &Path) -> Result<u64> {
        match self {
            MemberReader::File(f) => file_sectors(f, spec),
            MemberReader::Remote { dev, .. } => Ok(dev.topology().size_bytes / 512),
        }
    }

    /// Fills `buf` from `offset_bytes`.
    pub fn read_at(&self, offset_bytes: u64, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            MemberReader::File(f) => f.read_exact_at(buf, offset_bytes),
            MemberReader::Remote { dev, rt } => {
                let mut done = 0;
                while done < buf.len() {
                    let len = (buf.len() - done).min(REMOTE_READ_MAX_BYTES);
                    let piece = rt.block_on(read_aligned(dev, offset_bytes + done as u64, len))?;
                    buf[done..done + len].copy_from_slice(&piece);
                    done += len;
                }
                Ok(())
            }
        }
    }
}

fn open_remote(uri: &str) -> Result<MemberReader> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    let dev = rt
        .block_on(NbdDevice::connect(uri, NbdClientOptions::default()))
        .with_context(|| format!("{uri}: connecting to the NBD server (is it running and exporting that name?)"))?;
    Ok(MemberReader::Remote { dev, rt })
}

/// `len` bytes at `offset_bytes`, read in whole logical blocks of the export (a server may
/// take nothing smaller).
async fn read_aligned(dev: &NbdDevice, offset_bytes: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let block_bytes = u64::from(dev.topology().logical_block_bytes.max(1));
    let start = offset_bytes / block_bytes * block_bytes;
    let end = (offset_bytes + len as u64).div_ceil(block_bytes) * block_bytes;
    let buf_len = usize::try_from(end - start).map_err(std::io::Error::other)?;
    let (buf, r) = dev.read(start, IoBuf::zeroed(buf_len)).await;
    r?;
    let skip = (offset_bytes - start) as usize;
    Ok(buf.as_slice()[skip..skip + len].to_vec())
}

fn file_sectors(f: &std::fs::File, path: &Path) -> Result<u64> {
    let md = f.metadata().with_context(|| format!("{}", path.display()))?;
    if std::os::unix::fs::FileTypeExt::is_block_device(&md.file_type()) {
        let mut f2 = f.try_clone()?;
        let end = std::io::Seek::seek(&mut f2, std::io::SeekFrom::End(0))?;
        return Ok(end / 512);
    }
    Ok(md.len() / 512)
}
