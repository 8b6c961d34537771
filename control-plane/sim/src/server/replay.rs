//! The ZMQ side of a worker: where each rank's sockets are (endpoints
//! offset by the rank, or ports the worker picks and holds), the PUB socket
//! events go out on, and the replay ROUTER that answers
//! `[identity, "", start_seq]` with every kept batch from `start_seq` on,
//! then vLLM's end marker.

use std::net::{IpAddr, TcpListener};
use std::sync::Arc;

use parking_lot::Mutex;
use zeromq::{Socket as _, SocketRecv as _, SocketSend as _};

use super::{EventSockets, ReplayBuffer, SimError};

fn bind_error(what: &'static str, addr: &str, e: impl ToString) -> SimError {
    SimError::Bind { what, addr: addr.to_owned(), reason: e.to_string() }
}

/// Where one socket is bound: an endpoint, or a port already held.
#[derive(Debug)]
pub(super) enum Place {
    At(String),
    Held(TcpListener),
}

/// Every rank's places, from a worker's [`EventSockets`].
pub(super) struct Places<'a> {
    events: &'a EventSockets,
    /// [`EventSockets::Any`]: the ports held for the PUB sockets, in rank
    /// order, and for the replays.
    publish: std::vec::IntoIter<TcpListener>,
    replay: std::vec::IntoIter<TcpListener>,
}

impl<'a> Places<'a> {
    /// Picks and holds the ports of [`EventSockets::Any`] (for `ranks`
    /// ranks) at once.
    pub(super) fn new(events: &'a EventSockets, ranks: usize) -> Result<Self, SimError> {
        let mut publish = match events {
            EventSockets::Any(host) => hold_run(*host, 2 * ranks)?,
            _ => Vec::new(),
        };
        let replay = publish.split_off(publish.len().min(ranks));
        Ok(Places { events, publish: publish.into_iter(), replay: replay.into_iter() })
    }

    /// Rank `r`'s PUB and replay places; ranks are taken in order.
    pub(super) fn rank(&mut self, r: usize) -> Result<(Option<Place>, Option<Place>), SimError> {
        let offset = |e: &str| {
            let rank = u32::try_from(r).unwrap_or(u32::MAX);
            kvgate_vllm_wire::dp::rank_endpoint(e, rank).map(Place::At).map_err(|x| bind_error("ZMQ", e, x))
        };
        Ok(match self.events {
            EventSockets::Off => (None, None),
            EventSockets::At { publish, replay } => {
                (Some(offset(publish)?), replay.as_deref().map(offset).transpose()?)
            }
            EventSockets::Any(_) => (self.publish.next().map(Place::Held), self.replay.next().map(Place::Held)),
        })
    }
}

/// `n` consecutive TCP ports on `host`, bound and held: the first the
/// kernel's pick (port 0), the rest the ports after it; a run that meets a
/// taken port is let go and another picked.
fn hold_run(host: IpAddr, n: usize) -> Result<Vec<TcpListener>, SimError> {
    let addr = format!("{host}:0");
    for _ in 0..64 {
        let first = TcpListener::bind((host, 0)).map_err(|e| bind_error("ZMQ", &addr, e))?;
        let p = first.local_addr().map_err(|e| bind_error("ZMQ", &addr, e))?.port();
        let mut run = vec![first];
        for k in 1..n {
            match u16::try_from(k).ok().and_then(|k| p.checked_add(k)).map(|q| TcpListener::bind((host, q))) {
                Some(Ok(l)) => run.push(l),
                _ => break,
            }
        }
        if run.len() == n {
            return Ok(run);
        }
    }
    Err(bind_error("ZMQ", &addr, format!("no {n} consecutive free ports in 64 picks")))
}

/// Binds `socket` at `place`; the endpoint bound.
async fn bind(socket: &mut impl zeromq::Socket, what: &'static str, place: Place) -> Result<String, SimError> {
    let r = match place {
        Place::At(ep) => socket.bind(&ep).await.map_err(|e| bind_error(what, &ep, e)),
        Place::Held(l) => {
            let addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
            socket.bind_listener(l).await.map_err(|e| bind_error(what, &addr, e))
        }
    };
    r.map(|ep| ep.to_string())
}

/// The PUB socket, bound (as vLLM binds `tcp://*:port`), and its endpoint.
pub(super) async fn bind_publisher(place: Place) -> Result<(zeromq::PubSocket, String), SimError> {
    let mut s = zeromq::PubSocket::new();
    let ep = bind(&mut s, "ZMQ PUB", place).await?;
    Ok((s, ep))
}

/// The replay ROUTER socket, bound, and its endpoint.
pub(super) async fn bind_router(place: Place) -> Result<(zeromq::RouterSocket, String), SimError> {
    let mut router = zeromq::RouterSocket::new();
    let ep = bind(&mut router, "ZMQ replay", place).await?;
    Ok((router, ep))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The ports of a run follow each other and are held: another bind of
    /// any of them fails until the run is let go.
    #[test]
    fn a_run_of_ports_is_consecutive_and_held() {
        let host: IpAddr = [127, 0, 0, 1].into();
        let run = hold_run(host, 4).unwrap_or_default();
        let ports: Vec<u16> = run.iter().filter_map(|l| l.local_addr().ok()).map(|a| a.port()).collect();
        assert_eq!(ports.len(), 4, "{ports:?}");
        assert!(ports.windows(2).all(|w| w[1] == w[0] + 1), "{ports:?}");
        assert!(ports.iter().all(|&p| TcpListener::bind((host, p)).is_err()), "{ports:?} not held");
    }

    /// Each rank's places: offset endpoints, or the run held (rank r's PUB
    /// port P + r, its replay P + D + r).
    #[test]
    fn each_rank_takes_its_places() {
        let at = EventSockets::At { publish: "tcp://*:5557".into(), replay: Some("tcp://*:5559".into()) };
        let mut p = Places::new(&at, 2).unwrap_or_else(|e| panic!("{e}"));
        let (publish, replay) = p.rank(1).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(publish, Some(Place::At(ref e)) if e == "tcp://*:5558"), "{publish:?}");
        assert!(matches!(replay, Some(Place::At(ref e)) if e == "tcp://*:5560"), "{replay:?}");
        let any = EventSockets::Any([127, 0, 0, 1].into());
        let mut p = Places::new(&any, 2).unwrap_or_else(|e| panic!("{e}"));
        let port = |place: Option<Place>| match place {
            Some(Place::Held(l)) => l.local_addr().map(|a| a.port()).unwrap_or(0),
            other => panic!("{other:?}"),
        };
        let (p0, r0) = p.rank(0).unwrap_or_else(|e| panic!("{e}"));
        let (p1, r1) = p.rank(1).unwrap_or_else(|e| panic!("{e}"));
        let first = port(p0);
        assert_eq!([port(p1), port(r0), port(r1)], [first + 1, first + 2, first + 3]);
        let mut off = Places::new(&EventSockets::Off, 2).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(off.rank(0), Ok((None, None))));
    }
}
