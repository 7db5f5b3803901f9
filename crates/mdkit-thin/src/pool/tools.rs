//! Reading a running pool's metadata for the offline-style tools (dump, delta): through a
//! metadata snapshot, as `thin_dump -m` / `thin_delta -m` do against a live dm-thin pool.

use crate::meta::{MetaError, ThinMetadata};
use crate::pool::{Pool, PoolError, PoolErrorKind};

/// Which metadata snapshot a read uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapUse {
    /// Reserve one, read it, release it (fails when one is held already: one per pool).
    Transient,
    /// Read the one held now (`reserve_metadata_snap` earlier); fails when none is held.
    Held,
}

impl Pool {
    /// Runs `f` on the metadata worker against a metadata snapshot of the pool (see
    /// [`SnapUse`]). Other administrative changes wait meanwhile; I/O goes on.
    pub async fn read_metadata_snap<R: Send + 'static>(
        &self,
        snap: SnapUse,
        f: impl FnOnce(&ThinMetadata) -> Result<R, MetaError> + Send + 'static,
    ) -> Result<R, PoolError> {
        let _g = self.inner.admin.lock().await;
        if snap == SnapUse::Transient {
            self.admin(|md| md.reserve_metadata_snap()).await.map_err(|mut e| {
                if let PoolErrorKind::Meta(MetaError::MetadataSnap(m)) = &mut e.kind {
                    m.push_str(" (or read the held one: --metadata-snap)");
                }
                e
            })?;
        }
        let name = self.name().to_string();
        let r = self
            .inner
            .call(move |w| f(&w.md.read()))
            .await
            .and_then(|r| r.map_err(|e| PoolError::new(&name, PoolErrorKind::Meta(e))));
        if snap == SnapUse::Transient {
            let released = self.admin(|md| md.release_metadata_snap()).await;
            if r.is_ok() {
                released?;
            }
        }
        r
    }
}
