//! `kvgate`: the product's one command line.
//!
//! Every component is a subcommand of this one binary, so that one container
//! image (or one `cargo install`) carries the whole product and the demo
//! launcher can start each part as `kvgate <part>`. Subcommands arrive with
//! their issues; today:
//!
//! * `kvgate serve`: the control plane (gRPC Pick, live index, metrics);
//! * `kvgate relay`: the KV event relay sidecar (vLLM ZMQ events → NATS);
//! * `kvgate sim`: simulated vLLM workers for tests and benchmarks;
//! * `kvgate pd-sidecar`: the decode pod's sidecar of disaggregated serving;
//! * `kvgate hash`: block hashes of token ids (debugging routing decisions);
//! * `kvgate subject`: the NATS subjects of a model and worker;
//! * `kvgate version`.

//!
//! | module | subcommand |
//! |---|---|
//! | `serve.rs` | `serve`: flags, the configuration they make, the control plane |
//! | `relay.rs` | `relay` |
//! | `sim.rs` | `sim` |
//! | `pd.rs` | `pd-sidecar` |
//! | `envoy.rs` | `envoy-config` |
//! | `tools.rs` | `hash`, `subject` |

use anyhow::{Result, bail};
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

mod envoy;
mod pd;
mod relay;
mod serve;
mod sim;
mod tools;

#[derive(Parser)]
#[command(name = "kvgate", version, about = "KV-cache-aware routing for vLLM behind Envoy")]
pub struct Cli {
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
    /// Run the control plane: gRPC Pick/Report, live index from NATS, admin HTTP.
    Serve(Box<serve::ServeArgs>),
    /// Run the KV event relay next to one vLLM engine.
    Relay(Box<relay::RelayArgs>),
    /// Run simulated vLLM workers (OpenAI API, /metrics, ZMQ KV events).
    Sim(Box<sim::SimArgs>),
    /// Run the decode pod's P/D sidecar: the prefill leg on the worker named
    /// by x-prefiller-host-port, then the decode leg on the local vLLM.
    PdSidecar(Box<pd::PdArgs>),
    /// Print a plain-Envoy bootstrap with the kvgate filter (envoy/kvgate.yaml
    /// filled in): run it with `envoy -c FILE`.
    EnvoyConfig(Box<envoy::EnvoyConfigArgs>),
    /// Print the version.
    Version,
}

/// Logs to stderr, filtered by `KVGATE_LOG` (else `RUST_LOG`), `info` by
/// default: the control plane and the relay log alike.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVGATE_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

/// Runs the command line (`main` of the `kvgate` binary).
pub fn run() -> Result<()> {
    let matches = Cli::command().get_matches();
    if let Some(("serve", m)) = matches.subcommand() {
        let orphans = serve::model_flags_without_model(m);
        if !orphans.is_empty() {
            bail!("{} apply to --model: give --model too (or name the model in the --config file)", orphans.join(", "));
        }
    }
    match Cli::from_arg_matches(&matches)?.command {
        Command::Hash { block_size, lora, salt, tokens } => tools::hash(block_size, lora, salt, tokens)?,
        Command::Subject { model, worker, prefix } => tools::subject(&model, &worker, &prefix)?,
        Command::Serve(args) => serve::run(*args)?,
        Command::Sim(args) => sim::run(*args)?,
        Command::EnvoyConfig(args) => envoy::run(*args)?,
        Command::Relay(args) => relay::run(*args)?,
        Command::PdSidecar(args) => pd::run(*args)?,
        Command::Version => println!("kvgate {}", env!("CARGO_PKG_VERSION")),
    }
    Ok(())
}
