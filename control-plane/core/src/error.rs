//! Domain errors of the core. Adapters map them to their protocol: gRPC
//! codes in the `Router` service, HTTP statuses in the endpoint picker.

/// Why a Pick got no decision.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    /// The model is not served here.
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    /// The request is malformed or over a limit.
    #[error("{0}")]
    Invalid(String),
    /// No live (or allowed) worker.
    #[error("model {model:?}: {why}")]
    NoWorkers {
        /// The model.
        model: String,
        /// Why none.
        why: crate::model::NoWorker,
    },
    /// Messages were elided that this replica does not hold: the filter
    /// must send them again (not a failure of the request).
    #[error("elided messages not held here; send them again")]
    Resend,
    /// Every worker is saturated: the request is held in the model's
    /// admission queue (overload protection) until the ticket is released
    /// ([`crate::App::release_held`]); only [`crate::App::pick`] answers this.
    #[error("held while every worker is saturated (ticket {ticket})")]
    Held {
        /// The request's place in the queue.
        ticket: kvgate_scheduler::Ticket,
    },
    /// Every worker is saturated and the admission queue is full, or the
    /// request was held past its deadline: answer 429.
    #[error("every worker is saturated; retry after {retry_after_ms} ms")]
    Overloaded {
        /// Suggested wait before a retry.
        retry_after_ms: u32,
    },
}

/// Why the application could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A model's tokenizer did not load.
    #[error("model {model}: {source}")]
    Tokenizer {
        /// The model.
        model: String,
        /// The error.
        source: kvgate_tokenize::TokenizeError,
    },
}
