//! Picks held by overload protection (the core's admission queue): each
//! waits on a oneshot until the core releases its ticket or expires it. A
//! background task asks the core every 10 ms and whenever a report frees a
//! slot ([`Held::poke`]); it ends when the service is dropped.
//!
//! A ticket can be released before its handler starts waiting (the two run
//! on different tasks): the wake is then kept until the handler asks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use kvgate_core::{App, Ticket};
use tokio::sync::{Notify, oneshot};

/// What a held pick learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// A slot is free: pick now.
    Go,
    /// Held past its deadline: refuse.
    Expired,
}

enum Slot {
    Waiting(oneshot::Sender<Wake>),
    Woken(Wake),
}

#[derive(Default)]
struct Inner {
    slots: Mutex<HashMap<(String, Ticket), Slot>>,
    notify: Notify,
}

impl Inner {
    /// The slots (a panic elsewhere while holding them leaves a usable map).
    fn slots(&self) -> MutexGuard<'_, HashMap<(String, Ticket), Slot>> {
        self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The held picks of one gRPC service.
#[derive(Clone)]
pub struct Held {
    inner: Arc<Inner>,
}

/// A registered wait; dropping it before the wake (the client went away)
/// takes the ticket out of the queue.
pub struct Waiter {
    rx: oneshot::Receiver<Wake>,
    key: Option<(String, Ticket)>,
    held: Held,
    app: Arc<App>,
}

impl Waiter {
    /// The wake, or `Expired` if none comes within `limit`.
    pub async fn wake(mut self, limit: Duration) -> Wake {
        let w = tokio::time::timeout(limit, &mut self.rx).await;
        let wake = match w {
            Ok(Ok(w)) => w,
            _ => Wake::Expired,
        };
        if wake == Wake::Go {
            self.key = None;
        }
        wake
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if let Some((model, ticket)) = self.key.take() {
            self.held.inner.slots().remove(&(model.clone(), ticket));
            self.app.cancel_held(&model, ticket);
        }
    }
}

impl Held {
    /// No held picks; starts the releasing task for `app`.
    pub fn start(app: &Arc<App>) -> Self {
        let held = Self { inner: Arc::new(Inner::default()) };
        tokio::spawn(release_task(Arc::downgrade(&held.inner), Arc::downgrade(app)));
        held
    }

    /// Waits for `ticket` of `model`.
    pub fn wait(&self, app: &Arc<App>, model: &str, ticket: Ticket) -> Waiter {
        let (tx, rx) = oneshot::channel();
        let key = (model.to_owned(), ticket);
        let mut slots = self.inner.slots();
        match slots.remove(&key) {
            Some(Slot::Woken(w)) => {
                let _ = tx.send(w);
            }
            _ => {
                slots.insert(key.clone(), Slot::Waiting(tx));
            }
        }
        Waiter { rx, key: Some(key), held: self.clone(), app: app.clone() }
    }

    /// A slot may have freed (a report arrived): release now.
    pub fn poke(&self) {
        self.inner.notify.notify_one();
    }
}

fn wake(inner: &Inner, model: &str, ticket: Ticket, w: Wake) {
    let key = (model.to_owned(), ticket);
    let mut slots = inner.slots();
    match slots.remove(&key) {
        Some(Slot::Waiting(tx)) => {
            let _ = tx.send(w);
        }
        _ => {
            slots.insert(key, Slot::Woken(w));
        }
    }
}

async fn release_task(inner: Weak<Inner>, app: Weak<App>) {
    loop {
        let Some(notify_from) = inner.upgrade() else { return };
        let _ = tokio::time::timeout(Duration::from_millis(10), notify_from.notify.notified()).await;
        drop(notify_from);
        let (Some(inner), Some(app)) = (inner.upgrade(), app.upgrade()) else { return };
        for (model, r) in app.release_held() {
            for t in r.go {
                wake(&inner, &model, t, Wake::Go);
            }
            for t in r.expired {
                wake(&inner, &model, t, Wake::Expired);
            }
        }
    }
}
