//! Stopping the daemon's tasks: every task is spawned through [`Tasks`], which
//! ends it at its next await once the stop is given, so no loop needs a stop
//! check of its own and none can be forgotten.
//!
//! Ending a task at an await is safe for the state: the arbiter's lock is never
//! held across one, and a change cut off before its durable wait is one nobody
//! was told of, exactly as after a kill.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;

/// Resolves once the stop is given (or the [`Tasks`] it came from is gone).
#[derive(Clone)]
pub struct StopSignal(watch::Receiver<bool>);

impl StopSignal {
    pub async fn stopped(&mut self) {
        // An error means the sender is gone, which is a stop too.
        let _ = self.0.wait_for(|stopped| *stopped).await;
    }
}

/// The tasks of one daemon. Dropping it stops them (benchmarks and tests that
/// recover an arbiter and drop it).
pub struct Tasks {
    stop: watch::Sender<bool>,
    running: Mutex<JoinSet<()>>,
}

impl Default for Tasks {
    fn default() -> Self {
        Tasks {
            stop: watch::channel(false).0,
            running: Mutex::new(JoinSet::new()),
        }
    }
}

impl Tasks {
    pub fn signal(&self) -> StopSignal {
        StopSignal(self.stop.subscribe())
    }

    /// Runs `task` on the current runtime until it ends or the stop is given.
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let mut stop = self.signal();
        self.lock().spawn(async move {
            tokio::select! {
                () = task => {}
                () = stop.stopped() => {}
            }
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, JoinSet<()>> {
        // A JoinSet is consistent between calls; a panic elsewhere cannot break it.
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives the stop and waits for every task to end; one still running after
    /// `within` (stuck outside an await) is aborted. Returns how many were.
    pub async fn stop(&self, within: Duration) -> usize {
        self.stop.send_replace(true);
        let mut running = std::mem::take(&mut *self.lock());
        let all_ended = async { while running.join_next().await.is_some() {} };
        if tokio::time::timeout(within, all_ended).await.is_ok() {
            return 0;
        }
        let stuck = running.len();
        running.abort_all();
        stuck
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        // The JoinSet aborts what is left as it drops.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn the_stop_ends_every_task_at_its_next_await() {
        let tasks = Tasks::default();
        let ended = Arc::new(AtomicBool::new(false));
        struct Ends(Arc<AtomicBool>);
        impl Drop for Ends {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let guard = Ends(ended.clone());
        tasks.spawn(async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        });
        tasks.spawn(async {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        assert_eq!(tasks.stop(Duration::from_secs(5)).await, 0);
        assert!(ended.load(Ordering::SeqCst), "the task's state was dropped");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_stuck_outside_an_await_is_given_up_after_the_bound() {
        let tasks = Tasks::default();
        let (started, running) = tokio::sync::oneshot::channel();
        tasks.spawn(async move {
            let _ = started.send(());
            // Blocks its worker thread: the stop cannot reach it until it awaits.
            std::thread::sleep(Duration::from_millis(500));
            std::future::pending::<()>().await;
        });
        running.await.unwrap();
        let asked = std::time::Instant::now();
        assert_eq!(tasks.stop(Duration::from_millis(50)).await, 1);
        assert!(
            asked.elapsed() < Duration::from_millis(400),
            "not waited for"
        );
    }

    #[tokio::test]
    async fn a_signal_taken_before_the_stop_resolves_and_dropping_stops_too() {
        let tasks = Tasks::default();
        let mut before = tasks.signal();
        drop(tasks);
        tokio::time::timeout(Duration::from_secs(5), before.stopped())
            .await
            .expect("a dropped Tasks stops its tasks");
    }
}
