//! Member I/O wrappers: every personality and the sync engine reach members only through these.
//! They add the member's `data_offset`, refuse requests outside its data area (a bug, never sent
//! to the device), count requests in flight (least-busy reads), name the member and array in
//! errors, and fail the member on a write/flush error (md's Faulty), which also schedules the
//! superblock update that records it.
//!
//! Reads do not fail the member by themselves: a read error (an error, or fewer bytes than
//! asked) is the personality's to handle (try another copy, rewrite the bad one — md's
//! fix_read_error), and it fails the member with [`ArrayCore::fail_member_on_error`] when the
//! copy cannot be repaired. The wrapper only counts it, and for raid4/5/6 fails a member whose
//! failed reads in a row pass the stripe cache size (md's "too many read errors"). Errors come
//! back as [`super::errors::MdError`]s inside `io::Error`.
//!
//! Bad blocks ([`super::badblocks`], policy in `bblog.rs`): a read that touches a range the
//! member's bad-block log lists is refused without reaching the device (a
//! [`MdErrorKind::KnownBadBlock`] error the personality treats like a read error, minus the
//! error counting); a successful write or write-zeroes forgets the ranges it rewrote; a failed
//! one is recorded as bad blocks instead of failing the member when the level has redundancy
//! and the member's log has room.
//!
//! Also here: [`join_all`], a tiny concurrent join for member requests of one array request.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use mdkit_io::{DeviceError, IoBuf, IoErrorKind, IoFuture, IoOp, ReadResult, SharedBuf, WriteFlags, ZeroFlags};

use super::core::ArrayCore;
use super::errors::{MdError, MdErrorKind};
use super::member::Member;

const SECTOR_BYTES: u64 = 512;

/// Polls every future concurrently on the current task; the outputs come back in input order.
pub fn join_all<F: Future>(futs: impl IntoIterator<Item = F>) -> JoinAll<F> {
    let futs: Vec<Option<Pin<Box<F>>>> = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    let out = (0..futs.len()).map(|_| None).collect();
    JoinAll { futs, out }
}

pub struct JoinAll<F: Future> {
    futs: Vec<Option<Pin<Box<F>>>>,
    out: Vec<Option<F::Output>>,
}

impl<F: Future> Unpin for JoinAll<F> {}

impl<F: Future> Future for JoinAll<F> {
    type Output = Vec<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut pending = false;
        for (slot, out) in this.futs.iter_mut().zip(this.out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            return Poll::Pending;
        }
        // Every slot was filled exactly once (a slot is cleared only when its output is stored).
        Poll::Ready(this.out.iter_mut().map(|o| o.take().expect("each future completed once")).collect())
    }
}

/// Wraps a member's error into an [`MdError`] naming the array, member, operation and member
/// sector; the member's `io::ErrorKind` and typed [`DeviceError`] are kept, and the kind is
/// chosen from the typed error (a short read is not an I/O error), never from message text.
pub(crate) fn member_error(a: &ArrayCore, m: &Member, op: &'static str, sector: u64, e: io::Error) -> io::Error {
    let kind = match (op, DeviceError::kind_of(&e)) {
        ("read", IoErrorKind::ShortRead) => MdErrorKind::ShortRead,
        ("read", _) => MdErrorKind::MemberRead,
        _ => MdErrorKind::MemberWrite,
    };
    MdError::new(kind, a.name(), op, sector, e.to_string()).member(m.name()).io_kind(e.kind()).caused_by(&e).into()
}

/// Whether a member error is the caller's fault or a missing feature, not the member's: such
/// errors never fail the member.
fn is_request_error(e: &io::Error) -> bool {
    matches!(DeviceError::kind_of(e), IoErrorKind::InvalidRequest | IoErrorKind::Unsupported)
}

/// Errors that say the request was wrong, not the member: they never fail it.
pub(crate) fn is_caller_error(e: &io::Error) -> bool {
    is_request_error(e)
}

impl ArrayCore {
    fn check_member_range(&self, m: &Member, op: &'static str, sector: u64, len_sectors: u64) -> io::Result<u64> {
        match sector.checked_add(len_sectors) {
            Some(end) if end <= m.data_size_sectors => Ok((m.data_offset_sectors + sector) * SECTOR_BYTES),
            _ => Err(MdError::new(
                MdErrorKind::OutOfRange,
                self.name(),
                op,
                sector,
                format!("{len_sectors} sectors; the data area has {} sectors", m.data_size_sectors),
            )
            .member(m.name())
            .io_kind(io::ErrorKind::InvalidInput)
            .into()),
        }
    }

    /// Reads member sectors `[sector, sector + buf.len()/512)`. A read that fails or returns
    /// fewer bytes than asked is a read error: counted on the member (and, for raid4/5/6,
    /// failing it past the level's limit), otherwise left to the caller to handle. The buffer
    /// always comes back at the length asked for; after an error its contents are undefined.
    pub fn member_read<'a>(&'a self, m: &'a Member, sector: u64, buf: IoBuf) -> IoFuture<'a, ReadResult> {
        Box::pin(async move {
            let want = buf.len();
            let off = match self.check_member_range(m, "read", sector, want as u64 / SECTOR_BYTES) {
                Ok(o) => o,
                Err(e) => return (buf, Err(e)),
            };
            if let Some(bad) = m.bad_blocks().first_overlap(off / SECTOR_BYTES, want as u64 / SECTOR_BYTES) {
                // Never read a range the member's log calls bad; not a device read error.
                return (buf, Err(self.known_bad_block(m, sector, bad)));
            }
            let _g = m.io_started();
            let (buf, r) = m.device().read(off, buf).await;
            let r = match r {
                Ok(()) if buf.len() != want => {
                    let short =
                        DeviceError::new(IoErrorKind::ShortRead, m.device().name(), IoOp::Read, off, want as u64)
                            .detail(format!("{} of {want} bytes", buf.len()));
                    Err(member_error(self, m, "read", sector, short.into()))
                }
                Ok(()) => Ok(()),
                Err(e) => Err(member_error(self, m, "read", sector, e)),
            };
            match r {
                Ok(()) => {
                    m.note_read_ok();
                    (buf, Ok(()))
                }
                Err(e) => {
                    let in_a_row = m.note_read_error();
                    self.check_read_error_limit(m, in_a_row);
                    let buf = if buf.len() == want { buf } else { IoBuf::zeroed(want) };
                    (buf, Err(e))
                }
            }
        })
    }

    /// Writes member sectors; on error the member is failed (see [`ArrayCore::fail_member`]).
    pub fn member_write<'a>(
        &'a self,
        m: &'a Member,
        sector: u64,
        buf: SharedBuf,
        flags: WriteFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let len_sectors = buf.len() as u64 / SECTOR_BYTES;
            let off = self.check_member_range(m, "write", sector, len_sectors)?;
            let r = {
                let _g = m.io_started();
                m.device().write(off, buf.clone(), flags).await
            };
            match r {
                Ok(()) => {
                    self.note_good_write(m, sector, len_sectors);
                    Ok(())
                }
                Err(e) if is_caller_error(&e) => Err(member_error(self, m, "write", sector, e)),
                Err(e) => self.write_error(m, "write", sector, len_sectors, Some((&buf, flags)), e).await,
            }
        })
    }

    pub fn member_write_zeroes<'a>(
        &'a self,
        m: &'a Member,
        sector: u64,
        len_sectors: u64,
        flags: ZeroFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let off = self.check_member_range(m, "write_zeroes", sector, len_sectors)?;
            let r = {
                let _g = m.io_started();
                m.device().write_zeroes(off, len_sectors * SECTOR_BYTES, flags).await
            };
            match r {
                Ok(()) => {
                    self.note_good_write(m, sector, len_sectors);
                    Ok(())
                }
                Err(e) if is_caller_error(&e) => Err(member_error(self, m, "write_zeroes", sector, e)),
                Err(e) => self.write_error(m, "write_zeroes", sector, len_sectors, None, e).await,
            }
        })
    }

    /// Discard; an `Unsupported` answer is not a member failure.
    pub fn member_discard<'a>(&'a self, m: &'a Member, sector: u64, len_sectors: u64) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let off = self.check_member_range(m, "discard", sector, len_sectors)?;
            let _g = m.io_started();
            let r = m.device().discard(off, len_sectors * SECTOR_BYTES).await;
            self.after_modify(m, "discard", sector, r)
        })
    }

    /// Flushes the member's volatile cache; an error fails the member.
    pub fn member_flush<'a>(&'a self, m: &'a Member) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let _g = m.io_started();
            let r = m.device().flush().await;
            self.after_modify(m, "flush", 0, r)
        })
    }

    /// Writes metadata (superblock, bitmap) at an absolute member byte offset, FUA.
    pub(crate) fn member_write_meta<'a>(
        &'a self,
        m: &'a Member,
        offset_bytes: u64,
        buf: SharedBuf,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            debug_assert!(
                offset_bytes.is_multiple_of(4096) && buf.len().is_multiple_of(4096),
                "metadata writes are whole 4 KiB blocks"
            );
            let _g = m.io_started();
            m.device().write(offset_bytes, buf, WriteFlags::FUA).await.map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("{}: member {}: metadata write at byte {offset_bytes}: {e}", self.name(), m.name()),
                )
            })
        })
    }

    fn after_modify(&self, m: &Member, op: &'static str, sector: u64, r: io::Result<()>) -> io::Result<()> {
        match r {
            Ok(()) => Ok(()),
            Err(e) if is_request_error(&e) => Err(member_error(self, m, op, sector, e)),
            Err(e) => {
                let e = member_error(self, m, op, sector, e);
                self.fail_member_on_error(m, &e.to_string());
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn join_all_keeps_order() {
        let futs: Vec<IoFuture<'static, u32>> = (0..5u32)
            .map(|i| -> IoFuture<'static, u32> {
                Box::pin(async move {
                    tokio::time::sleep(std::time::Duration::from_millis(u64::from(5 - i))).await;
                    i
                })
            })
            .collect();
        assert_eq!(join_all(futs).await, vec![0, 1, 2, 3, 4]);
        let empty: Vec<IoFuture<'static, u32>> = Vec::new();
        assert!(join_all(empty).await.is_empty());
    }
}
