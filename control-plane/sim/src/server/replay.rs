//! The ZMQ side of a worker: the PUB socket events go out on, and the
//! replay ROUTER that answers `[identity, "", start_seq]` with every kept
//! batch from `start_seq` on, then vLLM's end marker.

use std::sync::Arc;

use parking_lot::Mutex;
use zeromq::{Socket as _, SocketRecv as _, SocketSend as _};

use super::{ReplayBuffer, SimError};

fn bind_error(what: &'static str, addr: &str, e: impl ToString) -> SimError {
    SimError::Bind { what, addr: addr.to_owned(), reason: e.to_string() }
}

/// The PUB socket, bound (as vLLM binds `tcp://*:port`), when configured.
pub(super) async fn bind_publisher(endpoint: Option<&str>) -> Result<Option<zeromq::PubSocket>, SimError> {
    let Some(ep) = endpoint else { return Ok(None) };
    let mut s = zeromq::PubSocket::new();
    s.bind(ep).await.map_err(|e| bind_error("ZMQ PUB", ep, e))?;
    Ok(Some(s))
}

/// The replay ROUTER socket, bound.
pub(super) async fn bind_router(endpoint: &str) -> Result<zeromq::RouterSocket, SimError> {
    let mut router = zeromq::RouterSocket::new();
    router.bind(endpoint).await.map_err(|e| bind_error("ZMQ replay", endpoint, e))?;
    Ok(router)
}

/// Answers replay requests until the socket fails.
pub(super) async fn serve(mut router: zeromq::RouterSocket, buf: Arc<Mutex<ReplayBuffer>>, topic: String) {
    while let Ok(msg) = router.recv().await {
        // [identity, "", start_seq(8 bytes BE)]
        let frames: Vec<Vec<u8>> = msg.iter().map(|f| f.to_vec()).collect();
        let Some(id) = frames.first().cloned() else { continue };
        let start =
            frames.last().and_then(|f| <[u8; 8]>::try_from(f.as_slice()).ok()).map(u64::from_be_bytes).unwrap_or(0);
        let batches: Vec<(u64, Vec<u8>)> = buf.lock().iter().filter(|(s, _)| *s >= start).cloned().collect();
        // vLLM ≥ 0.30 layout: [id, "", topic, seq, payload] ... [id, "", "", ff×8, ""].
        for (seq, payload) in batches {
            let mut m = zeromq::ZmqMessage::from(id.clone());
            m.push_back(Vec::<u8>::new().into());
            m.push_back(topic.as_bytes().to_vec().into());
            m.push_back(seq.to_be_bytes().to_vec().into());
            m.push_back(payload.into());
            if router.send(m).await.is_err() {
                break;
            }
        }
        let mut end = zeromq::ZmqMessage::from(id);
        end.push_back(Vec::<u8>::new().into());
        end.push_back(Vec::<u8>::new().into());
        end.push_back(vec![0xff; 8].into());
        end.push_back(Vec::<u8>::new().into());
        let _ = router.send(end).await;
    }
}
