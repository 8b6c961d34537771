//! Data-parallel ranks: a vLLM server started with `--data-parallel-size N`
//! runs N engines behind one API endpoint. Each rank has its own KV cache,
//! publishes its own events on its own socket
//! ([`kvgate_vllm_wire::dp::rank_endpoint`]) and labels its metrics
//! `engine="<rank>"`; the API server sends a request to the rank named in
//! its `x-data-parallel-rank` header. The relay therefore follows each rank
//! as a worker of its own: worker id `<id>/dp<rank>`, same endpoint, the
//! rank in its heartbeats.

pub use kvgate_vllm_wire::dp::{RankError, rank_endpoint};

/// The worker id of rank `rank` of a server whose relay is `base` (`size`
/// ranks): `base` itself for a server of one rank, `<base>/dp<rank>`
/// otherwise.
pub fn rank_worker_id(base: &str, rank: u32, size: u32) -> String {
    if size <= 1 { base.to_owned() } else { format!("{base}/dp{rank}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_name_the_rank_only_when_there_are_several() {
        assert_eq!(rank_worker_id("10.0.0.7:8000", 0, 1), "10.0.0.7:8000");
        assert_eq!(rank_worker_id("10.0.0.7:8000", 0, 2), "10.0.0.7:8000/dp0");
        assert_eq!(rank_worker_id("10.0.0.7:8000", 1, 2), "10.0.0.7:8000/dp1");
    }
}
