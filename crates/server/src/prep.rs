//! A fixed pool of threads that prepare requests (parse, chat template,
//! tokenize) off the threads that answer HTTP.
//!
//! A fixed set of threads rather than tokio's blocking pool: glibc gives
//! each thread that allocates under contention an arena of its own and keeps
//! what was freed there, so preparation spread over a changing crowd of
//! blocking threads leaves the peak of a large body behind in many arenas.
//! With a few long-lived threads the same work reuses the same few arenas,
//! and `malloc_trim` after a large body hands the rest back.

use std::sync::{Arc, Mutex, mpsc};

type Job = Box<dyn FnOnce() + Send>;

/// The pool: jobs run in arrival order on `n` threads.
pub struct PrepPool {
    tx: mpsc::Sender<Job>,
}

impl PrepPool {
    /// Start `n` (at least 1) threads.
    pub fn new(n: usize) -> std::io::Result<PrepPool> {
        let n = n.max(1);
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..n {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("samesum-prep-{i}"))
                .spawn(move || {
                    loop {
                        let job = match rx.lock() {
                            Ok(r) => r.recv(),
                            Err(_) => return,
                        };
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                })?;
        }
        Ok(PrepPool { tx })
    }

    /// Run `f` on the pool and wait for its result; `None` if it panicked.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r.ok());
        });
        self.tx.send(job).ok()?;
        rx.await.ok().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jobs_run_on_the_pool_and_a_panic_is_none() {
        let pool = PrepPool::new(2).unwrap();
        let name = pool
            .run(|| std::thread::current().name().map(String::from))
            .await;
        assert!(name.flatten().unwrap().starts_with("samesum-prep-"));
        assert_eq!(pool.run(|| -> u32 { panic!("bad") }).await, None);
        // The pool still serves after a panic.
        assert_eq!(pool.run(|| 7).await, Some(7));
    }
}
