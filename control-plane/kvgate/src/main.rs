//! `kvgate`: the product's one command line.
//!
//! Every component is a subcommand of this one binary, so that one container
//! image (or one `cargo install`) carries the whole product and the demo
//! launcher can start each part as `kvgate <part>`. Subcommands arrive with
//! their issues; today:
//!
//! * `kvgate hash`: block hashes of token ids (debugging routing decisions);
//! * `kvgate subject`: the NATS subjects of a model and worker;
//! * `kvgate version`.

use std::io::Read;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use kvgate_protocol::subject::{SubjectKind, Subjects};
use kvgate_protocol::{BlockSeed, BlockSize, local_block_hashes, sequence_hashes};

#[derive(Parser)]
#[command(name = "kvgate", version, about = "KV-cache-aware routing for vLLM behind Envoy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the project's block hashes (Dynamo-compatible xxh3) of token ids.
    Hash {
        /// Tokens per block.
        #[arg(long)]
        block_size: u32,
        /// LoRA adapter name, if any.
        #[arg(long)]
        lora: Option<String>,
        /// cache_salt, if any.
        #[arg(long)]
        salt: Option<String>,
        /// Token ids separated by commas or white space; `-` (default) reads stdin.
        #[arg(default_value = "-")]
        tokens: String,
    },
    /// Print the NATS subjects kvgate uses for a model and worker.
    Subject {
        /// Served model name, e.g. meta-llama/Llama-3.1-70B-Instruct.
        #[arg(long)]
        model: String,
        /// Worker id, e.g. 10.0.0.7:8000.
        #[arg(long, default_value = "")]
        worker: String,
        /// Subject prefix.
        #[arg(long, default_value = kvgate_protocol::subject::DEFAULT_PREFIX)]
        prefix: String,
    },
    /// Print the version.
    Version,
}

fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c == ',' || c.is_whitespace() || c == '[' || c == ']')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().with_context(|| format!("token id {s:?} is not a u32")))
        .collect()
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Hash { block_size, lora, salt, tokens } => {
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
        }
        Command::Subject { model, worker, prefix } => {
            let s = Subjects::new(&prefix)?;
            println!("kv events:  {}", s.kv_events(&model, &worker));
            println!("heartbeat:  {}", s.heartbeat(&model, &worker));
            println!("snapshot:   {}", s.snapshot(&model, &worker));
            println!("inflight:   {}", s.inflight(&model));
            println!("subscribe:  {}  {}", s.model(SubjectKind::KvEvents, &model), s.all(SubjectKind::KvEvents));
        }
        Command::Version => println!("kvgate {}", env!("CARGO_PKG_VERSION")),
    }
    Ok(())
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
