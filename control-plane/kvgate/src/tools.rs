//! `kvgate hash` and `kvgate subject`: the block hashes of token ids and
//! the NATS subjects of a model and worker, for debugging routing.

use std::io::Read;

use anyhow::{Context, Result, bail};
use kvgate_protocol::subject::{SubjectKind, Subjects};
use kvgate_protocol::{BlockSeed, BlockSize, local_block_hashes, sequence_hashes};

/// `kvgate hash`.
pub(crate) fn hash(block_size: u32, lora: Option<String>, salt: Option<String>, tokens: String) -> Result<()> {
    let bs = BlockSize::new(block_size).context("--block-size")?;
    let text = if tokens == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading stdin")?;
        s
    } else {
        tokens
    };
    let tokens = parse_tokens(&text)?;
    if tokens.is_empty() {
        bail!("no token ids given");
    }
    let seed = BlockSeed::new(lora.as_deref(), salt.as_deref());
    let local: Vec<String> = local_block_hashes(&tokens, bs, seed).map(|h| h.to_string()).collect();
    let seq: Vec<String> = sequence_hashes(&tokens, bs, seed).iter().map(|h| h.to_string()).collect();
    let out = serde_json::json!({
        "block_size": block_size,
        "block_seed": seed.get().to_string(),
        "tokens": tokens.len(),
        "full_blocks": local.len(),
        "local_hashes": local,
        "sequence_hashes": seq,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// `kvgate subject`.
pub(crate) fn subject(model: &str, worker: &str, prefix: &str) -> Result<()> {
    let s = Subjects::new(prefix)?;
    println!("kv events:  {}", s.kv_events(model, worker));
    println!("heartbeat:  {}", s.heartbeat(model, worker));
    println!("snapshot:   {}", s.snapshot(model, worker));
    println!("inflight:   {}", s.inflight(model));
    println!("subscribe:  {}  {}", s.model(SubjectKind::KvEvents, model), s.all(SubjectKind::KvEvents));
    Ok(())
}

fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c == ',' || c.is_whitespace() || c == '[' || c == ']')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().with_context(|| format!("token id {s:?} is not a u32")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::parse_tokens;

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("1, 2 3\n[4]").unwrap(), vec![1, 2, 3, 4]);
        assert!(parse_tokens("1,-2").is_err());
        assert!(parse_tokens("x").unwrap_err().to_string().contains("\"x\""));
    }
}
