//! Buffered reading of the request stream.
//!
//! One `read()` on the socket pulls in as many requests as the kernel has queued (at QD32
//! with 4 KiB writes that is ~130 KiB: dozens of requests for one syscall). Headers are parsed
//! straight out of that buffer. Payloads are placed into the request's own aligned `IoBuf`:
//! the bytes that arrived together with earlier data are copied out of the receive buffer once
//! (a 4 KiB memcpy costs far less than the extra syscall it saves); the rest of any payload of
//! [`DIRECT_READ_MIN_BYTES`] or more is read from the socket directly into the `IoBuf`, so
//! large writes are never copied in user space.

#[cfg(test)]
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, ReadBuf};

use crate::proto::REQUEST_HEADER_BYTES;

/// Size of the receive buffer.
pub const RECV_BUFFER_BYTES: usize = 256 << 10;
/// Payload remainders at least this long bypass the receive buffer.
pub const DIRECT_READ_MIN_BYTES: usize = 32 << 10;

pub struct RequestReader<R> {
    inner: R,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

/// Progress of one payload being read: `filled` bytes of the destination are done.
#[derive(Debug, Default)]
pub struct PayloadProgress {
    pub filled: usize,
}

impl<R: AsyncRead + Unpin> RequestReader<R> {
    pub fn new(inner: R) -> RequestReader<R> {
        RequestReader { inner, buf: vec![0u8; RECV_BUFFER_BYTES].into_boxed_slice(), start: 0, end: 0 }
    }

    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Reads more from the socket into the buffer; returns the number of bytes added (0 = EOF).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.buf.len() - self.end < REQUEST_HEADER_BYTES {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let mut rb = ReadBuf::new(&mut self.buf[self.end..]);
        ready!(Pin::new(&mut self.inner).poll_read(cx, &mut rb))?;
        let n = rb.filled().len();
        self.end += n;
        Poll::Ready(Ok(n))
    }

    /// The next request header, or `None` on a clean end of stream between requests. Cancel-safe:
    /// bytes read stay buffered until a whole header is there.
    pub fn poll_header(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<[u8; REQUEST_HEADER_BYTES]>>> {
        while self.buffered() < REQUEST_HEADER_BYTES {
            if ready!(self.poll_fill(cx))? == 0 {
                if self.buffered() == 0 {
                    return Poll::Ready(Ok(None));
                }
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a request header",
                )));
            }
        }
        let mut h = [0u8; REQUEST_HEADER_BYTES];
        h.copy_from_slice(&self.buf[self.start..self.start + REQUEST_HEADER_BYTES]);
        self.start += REQUEST_HEADER_BYTES;
        Poll::Ready(Ok(Some(h)))
    }

    /// Fills `dst` completely from the stream, resuming at `progress` (kept by the caller across
    /// `Pending`). Buffered bytes are copied; a remainder of [`DIRECT_READ_MIN_BYTES`] or more is
    /// read from the socket straight into `dst`.
    pub fn poll_payload(
        &mut self,
        cx: &mut Context<'_>,
        dst: &mut [u8],
        progress: &mut PayloadProgress,
    ) -> Poll<io::Result<()>> {
        progress.filled += self.take_buffered(&mut dst[progress.filled..]);
        while progress.filled < dst.len() {
            let rest = dst.len() - progress.filled;
            let n = if rest >= DIRECT_READ_MIN_BYTES {
                let mut rb = ReadBuf::new(&mut dst[progress.filled..]);
                ready!(Pin::new(&mut self.inner).poll_read(cx, &mut rb))?;
                let n = rb.filled().len();
                progress.filled += n;
                n
            } else {
                let n = ready!(self.poll_fill(cx))?;
                progress.filled += self.take_buffered(&mut dst[progress.filled..]);
                n
            };
            if n == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a write payload",
                )));
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Skips `*left` bytes of payload without allocating for them; `*left` counts down.
    pub fn poll_discard(&mut self, cx: &mut Context<'_>, left: &mut u64) -> Poll<io::Result<()>> {
        loop {
            let n = (self.buffered() as u64).min(*left);
            self.start += n as usize;
            *left -= n;
            if *left == 0 {
                return Poll::Ready(Ok(()));
            }
            if ready!(self.poll_fill(cx))? == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a write payload",
                )));
            }
        }
    }

    #[cfg(test)]
    /// Async form of [`poll_header`](Self::poll_header).
    pub async fn read_header(&mut self) -> io::Result<Option<[u8; REQUEST_HEADER_BYTES]>> {
        poll_fn(|cx| self.poll_header(cx)).await
    }

    #[cfg(test)]
    /// Async form of [`poll_payload`](Self::poll_payload).
    pub async fn read_payload(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let mut progress = PayloadProgress::default();
        poll_fn(|cx| self.poll_payload(cx, dst, &mut progress)).await
    }

    #[cfg(test)]
    /// Async form of [`poll_discard`](Self::poll_discard).
    pub async fn discard(&mut self, len: u64) -> io::Result<()> {
        let mut left = len;
        poll_fn(|cx| self.poll_discard(cx, &mut left)).await
    }

    fn take_buffered(&mut self, dst: &mut [u8]) -> usize {
        let n = self.buffered().min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn headers_and_payloads_across_arbitrary_read_boundaries() {
        let mut stream = Vec::new();
        for i in 0..50u8 {
            stream.extend_from_slice(&[i; REQUEST_HEADER_BYTES]);
            let plen = if i % 7 == 0 { 100_000 } else { usize::from(i) * 13 };
            stream.extend_from_slice(&(plen as u32).to_be_bytes());
            stream.extend(std::iter::repeat_n(i, plen));
        }
        // A reader that hands out odd-sized pieces.
        let (mut a, b) = tokio::io::duplex(7919);
        let data = stream.clone();
        let w = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for chunk in data.chunks(3331) {
                a.write_all(chunk).await.unwrap();
            }
        });
        let mut r = RequestReader::new(b);
        for i in 0..50u8 {
            let h = r.read_header().await.unwrap().unwrap();
            assert!(h.iter().all(|&x| x == i));
            let mut l = [0u8; 4];
            r.read_payload(&mut l).await.unwrap();
            let plen = u32::from_be_bytes(l) as usize;
            if i % 3 == 0 {
                r.discard(plen as u64).await.unwrap();
            } else {
                let mut p = vec![0u8; plen];
                r.read_payload(&mut p).await.unwrap();
                assert!(p.iter().all(|&x| x == i), "payload {i}");
            }
        }
        w.await.unwrap();
        assert!(r.read_header().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn truncated_header_is_an_error_not_a_clean_eof() {
        let (a, b) = tokio::io::duplex(64);
        let w = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let mut a = a;
            a.write_all(&[1u8; 10]).await.unwrap();
        });
        let mut r = RequestReader::new(b);
        w.await.unwrap();
        assert_eq!(r.read_header().await.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
