//! Data-parallel ranks on the wire: a vLLM server started with
//! `--data-parallel-size N` runs N engines, and rank r publishes its events
//! on the configured endpoint offset by r (vLLM's
//! `ZmqEventPublisher.offset_endpoint_port`): a tcp port plus r, an inproc
//! name with `_dp<r>` appended; the replay endpoint likewise. Each batch names its rank
//! (`[ts, events, dp_rank]`).
//!
//! Cost: O(len(endpoint)).

/// Why a rank's endpoint cannot be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RankError {
    /// vLLM offsets only tcp ports (and inproc names); an ipc endpoint is
    /// the same for every rank and vLLM refuses it.
    #[error("endpoint {0:?}: only tcp:// (and inproc://) event endpoints can serve several data-parallel ranks")]
    NotOffsettable(String),
    /// A tcp endpoint without a port, or port 0 (the OS picks: no rule
    /// tells where rank N is).
    #[error("endpoint {0:?}: a data-parallel server needs an explicit tcp port (rank N publishes on port + N)")]
    NoPort(String),
    /// The offset port is beyond 65535.
    #[error("endpoint {0:?}: port + rank {1} is beyond 65535")]
    PortOverflow(String, u32),
}

/// The endpoint of rank `rank`'s socket, as vLLM derives it from the
/// configured one: `tcp://host:P` → `tcp://host:P+rank`, `inproc://x` →
/// `inproc://x_dp<rank>`; rank 0 keeps the endpoint as it is.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, RankError> {
    if rank == 0 {
        return Ok(endpoint.to_owned());
    }
    if endpoint.starts_with("inproc://") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    if !endpoint.starts_with("tcp://") {
        return Err(RankError::NotOffsettable(endpoint.to_owned()));
    }
    let (base, port) = endpoint.rsplit_once(':').ok_or_else(|| RankError::NoPort(endpoint.to_owned()))?;
    let port: u32 = port.parse().map_err(|_| RankError::NoPort(endpoint.to_owned()))?;
    if port == 0 || base == "tcp" {
        return Err(RankError::NoPort(endpoint.to_owned()));
    }
    let p = port.checked_add(rank).filter(|p| *p <= 65535).ok_or(RankError::PortOverflow(endpoint.to_owned(), rank))?;
    Ok(format!("{base}:{p}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_vllms_rule() {
        let cases: &[(&str, u32, Result<&str, ()>)] = &[
            ("tcp://*:5557", 0, Ok("tcp://*:5557")),
            ("tcp://*:5557", 3, Ok("tcp://*:5560")),
            ("tcp://127.0.0.1:5557", 1, Ok("tcp://127.0.0.1:5558")),
            ("tcp://[::1]:5557", 2, Ok("tcp://[::1]:5559")),
            ("inproc://cache", 1, Ok("inproc://cache_dp1")),
            ("ipc:///tmp/kv", 0, Ok("ipc:///tmp/kv")),
            ("ipc:///tmp/kv", 1, Err(())),
            ("tcp://*:0", 1, Err(())),
            ("tcp://host", 1, Err(())),
            ("tcp://*:65535", 1, Err(())),
        ];
        for (e, r, want) in cases {
            assert_eq!(rank_endpoint(e, *r).map_err(|_| ()), want.map(str::to_owned), "{e} rank {r}");
        }
    }
}
