//! Small async helpers for the data path.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future that runs to completion even if the caller drops it (the `BlockDevice` contract:
/// "a future may be dropped before it completes: the I/O then still runs to completion").
/// It is polled in place while the caller waits; if dropped unfinished, the remainder is
/// spawned on the current runtime — so cells are released, in-flight counts drop only after the data
/// device is done, and no block is reused while an abandoned write is still landing.
pub(crate) struct Detached<T: Send + 'static> {
    inner: Option<Pin<Box<dyn Future<Output = T> + Send + 'static>>>,
}

impl<T: Send + 'static> Detached<T> {
    pub fn new(f: impl Future<Output = T> + Send + 'static) -> Detached<T> {
        Detached { inner: Some(Box::pin(f)) }
    }
}

impl<T: Send + 'static> Future for Detached<T> {
    type Output = T;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(f) = self.inner.as_mut() else {
            // Polled after completion: a caller bug; never complete again.
            return Poll::Pending;
        };
        match f.as_mut().poll(cx) {
            Poll::Ready(v) => {
                self.inner = None;
                Poll::Ready(v)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        if let Some(f) = self.inner.take() {
            // Outside any runtime (it is shutting down, or the caller is a plain thread) the
            // future is dropped: its guards still release cells and in-flight counts.
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = f.await;
                });
            }
        }
    }
}

/// Polls every future until all are done; results in input order.
pub(crate) async fn join_all<'a, T>(futs: Vec<Pin<Box<dyn Future<Output = T> + Send + 'a>>>) -> Vec<T> {
    let mut futs: Vec<Option<Pin<Box<dyn Future<Output = T> + Send + 'a>>>> = futs.into_iter().map(Some).collect();
    let mut out: Vec<Option<T>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, res) in futs.iter_mut().zip(out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => {
                        *res = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending { Poll::Pending } else { Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|v| v.expect("every future completed")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn dropped_detached_future_still_completes() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let _guard = rt.enter();
        let fut = Detached::new(async move {
            let _ = rx.await;
            d.store(true, Ordering::SeqCst);
        });
        drop(fut);
        tx.send(()).unwrap();
        rt.block_on(async {
            // Polls the flag; the limit is a hang guard (was 0.5 s: too short on a busy machine).
            let waiting = std::time::Instant::now();
            while !done.load(Ordering::SeqCst) {
                assert!(
                    waiting.elapsed() < std::time::Duration::from_secs(60),
                    "the abandoned future did not run to completion"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        });
    }

    #[test]
    fn join_all_keeps_order() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let v = rt.block_on(join_all(
            (0..5u64)
                .map(|i| {
                    Box::pin(async move {
                        tokio::time::sleep(std::time::Duration::from_millis(5 - i)).await;
                        i
                    }) as Pin<Box<dyn Future<Output = u64> + Send>>
                })
                .collect(),
        ));
        assert_eq!(v, vec![0, 1, 2, 3, 4]);
    }
}
