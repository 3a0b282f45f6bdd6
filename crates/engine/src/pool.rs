//! A small spinning thread pool for the forward pass.
//!
//! Decode runs dozens of short parallel regions per token; waking sleeping
//! threads for each costs more than the work. Workers here spin briefly on a
//! generation counter, then park; the caller takes part in every region. Which
//! thread runs which task never changes a value: tasks write disjoint outputs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// (generation << 32) | next task index.
    ticket: AtomicU64,
    /// Tasks finished in the current job.
    done: AtomicUsize,
    /// The current job: its generation, the function and its task count, set
    /// together under the lock before the ticket announces the generation. A
    /// worker claims tasks only for the generation it read here, so it never
    /// pairs one run's generation with the next run's job or count.
    job: std::sync::Mutex<Option<Current>>,
    /// The first panic of the current run's tasks, re-raised by `run` once
    /// every task has finished (a task that panics still counts as done, so
    /// the run neither hangs nor returns while other tasks use its closure).
    panic: std::sync::Mutex<Option<Box<dyn std::any::Any + Send>>>,
    shutdown: AtomicBool,
}

#[derive(Clone, Copy)]
struct Current {
    generation: u64,
    job: Job,
    n: usize,
}
// SAFETY: the job is a `dyn Fn + Sync`; it is only called while `run` keeps it alive.
unsafe impl Send for Current {}

/// The pool.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
}

const SPINS: u32 = 1 << 16;

impl Pool {
    /// A pool of `threads` threads in all, the caller included (0: all cores).
    pub fn new(threads: usize) -> Pool {
        let threads = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        let shared = Arc::new(Shared {
            ticket: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: std::sync::Mutex::new(None),
            panic: std::sync::Mutex::new(None),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("samesum-worker-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawn worker thread")
            })
            .collect();
        Pool {
            shared,
            workers,
            threads,
        }
    }

    /// Threads in all (the caller included).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `f(i)` for every `i` in `0..n`, spread over the pool; returns when all
    /// are done.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 0 {
            return;
        }
        if self.workers.is_empty() || n == 1 {
            (0..n).for_each(f);
            return;
        }
        let s = &*self.shared;
        // SAFETY: the pointer is erased to 'static only for the duration of this
        // call: workers call it only while claiming tasks of this generation, and
        // this function returns only after every task has finished.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        let gen_next = (s.ticket.load(Ordering::Relaxed) >> 32) + 1;
        s.done.store(0, Ordering::Relaxed);
        *s.job.lock().expect("pool lock") = Some(Current {
            generation: gen_next,
            job,
            n,
        });
        s.ticket.store(gen_next << 32, Ordering::Release);
        for w in &self.workers {
            w.thread().unpark();
        }
        claim_tasks(s, gen_next, n, job);
        while s.done.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
        *s.job.lock().expect("pool lock") = None;
        let panicked = s.panic.lock().map(|mut p| p.take()).unwrap_or(None);
        if let Some(p) = panicked {
            std::panic::resume_unwind(p);
        }
    }

    /// Call `f(i, &mut items[i])` for every item, in parallel.
    pub fn for_each_mut<T: Send>(&self, items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
        let base = items.as_mut_ptr() as usize;
        let n = items.len();
        self.run(n, &|i| {
            // SAFETY: each index is claimed by exactly one task, so the &mut are disjoint.
            let item = unsafe { &mut *(base as *mut T).add(i) };
            f(i, item)
        });
    }
}

/// Claim and run tasks of generation `gen` until none remain.
fn claim_tasks(s: &Shared, gen_: u64, n: usize, job: Job) {
    loop {
        let t = s.ticket.load(Ordering::Acquire);
        if t >> 32 != gen_ {
            return;
        }
        let i = (t & 0xffff_ffff) as usize;
        if i >= n {
            return;
        }
        if s.ticket
            .compare_exchange_weak(t, t + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // SAFETY: a task of the current generation was claimed, so `run` is
            // still waiting and the job is alive.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*job)(i) }));
            if let Err(p) = r
                && let Ok(mut first) = s.panic.lock()
            {
                first.get_or_insert(p);
            }
            s.done.fetch_add(1, Ordering::Release);
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        let gen_ = loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let g = s.ticket.load(Ordering::Acquire) >> 32;
            if g != seen {
                break g;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::park_timeout(std::time::Duration::from_millis(5));
            }
        };
        seen = gen_;
        // The job may already be a later run's (or gone): claim_tasks checks
        // the ticket against the generation stored with it.
        let current = *s.job.lock().expect("pool lock");
        let Some(c) = current else { continue };
        claim_tasks(s, c.generation, c.n, c.job);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        let pool = Pool::new(3);
        for n in [0, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
        let mut v = vec![0usize; 500];
        for round in 0..200 {
            pool.for_each_mut(&mut v, |i, x| *x += i + round);
        }
        assert!(
            v.iter()
                .enumerate()
                .all(|(i, &x)| x == 200 * i + (0..200).sum::<usize>())
        );
    }

    /// A panicking task (on a worker or on the caller) makes `run` panic
    /// with its message after every other task has finished: no hang, and
    /// the pool works afterwards.
    #[test]
    fn a_panicking_task_is_raised_by_run_after_the_others_finish() {
        let pool = Pool::new(3);
        for bad in [0usize, 5, 63] {
            let hits: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run(64, &|i| {
                    if i == bad {
                        panic!("task {i} failed");
                    }
                    hits[i].fetch_add(1, Ordering::Relaxed);
                })
            }));
            let msg = r.expect_err("run must raise the task's panic");
            let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
            assert_eq!(msg, format!("task {bad} failed"));
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(h.load(Ordering::Relaxed), (i != bad) as usize, "task {i}");
            }
        }
        let mut v = vec![0usize; 100];
        pool.for_each_mut(&mut v, |i, x| *x = i);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i));
    }

    /// A run returns only after every task of its own job ran, exactly once,
    /// even when back-to-back runs alternate small and large task counts
    /// (a worker that saw one run's generation must never claim tasks with
    /// the next run's job or count).
    #[test]
    fn back_to_back_runs_never_mix_jobs() {
        let pool = Pool::new(4);
        for round in 0..20_000usize {
            let n = if round % 2 == 0 { 2 } else { 3 + round % 61 };
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(
                    h.load(Ordering::Relaxed),
                    1,
                    "round {round}: task {i} of {n}"
                );
            }
        }
    }
}
