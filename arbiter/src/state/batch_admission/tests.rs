//! The batch search off the lock: the queue waits for it, its outcome is applied
//! only on the leases and waiters it was computed on, and a handle drives it.

use super::super::tests::{config, open_with_probe, request};
use super::*;
use crate::process::tests::FakeProcs;
use gpushare_config::PlacementConfig;

/// One 8 GiB GPU held by an 8 GiB filler, with 5, 4 and 4 GiB requests waiting
/// behind it (one at a time would place the 5 GiB one alone; the batch, both 4s).
struct Waiting {
    _dir: tempfile::TempDir,
    arbiter: Arbiter,
    filler: LeaseId,
    replies: Vec<ReserveReply>,
}

fn three_waiting_behind_a_filler(off_the_lock: bool) -> Waiting {
    let dir = tempfile::tempdir().unwrap();
    let mut arbiter = open_with_probe(config(dir.path()), 1, Box::new(FakeProcs::default()));
    arbiter.set_placement(PlacementConfig {
        batch: true,
        ..Default::default()
    });
    arbiter.set_batch_search_off_the_lock(off_the_lock);
    let filler = arbiter
        .reserve_now(request("filler", "8Gi", Priority::Low))
        .unwrap()
        .lease
        .id;
    let replies = [("five", "5Gi"), ("four", "4Gi"), ("four-too", "4Gi")]
        .into_iter()
        .map(|(name, memory)| arbiter.submit(request(name, memory, Priority::Low), Instant::now()))
        .collect();
    Waiting {
        _dir: dir,
        arbiter,
        filler,
        replies,
    }
}

fn granted(replies: &mut [ReserveReply]) -> Vec<bool> {
    replies
        .iter_mut()
        .map(|r| matches!(r.try_recv(), Ok(Ok(_))))
        .collect()
}

#[test]
fn off_the_lock_the_queue_waits_for_the_search_then_takes_its_plan() {
    let mut w = three_waiting_behind_a_filler(true);
    // The waiters' own search (they wait): take it out and drop it unanswered first.
    let queued = w.arbiter.batch_search_to_start();
    assert!(
        queued.is_some(),
        "waiters queued behind the filler asked for a search"
    );
    w.arbiter
        .finish_batch_search(queued.map(BatchSearchJob::run));
    w.arbiter.release(&w.filler).unwrap();
    assert_eq!(
        granted(&mut w.replies),
        vec![false, false, false],
        "nothing is placed before the search has answered"
    );
    let job = w
        .arbiter
        .batch_search_to_start()
        .expect("a search is wanted");
    // While the job is out, the state answers and changes without it.
    assert_eq!(w.arbiter.status().queue.len(), 3);
    assert!(
        w.arbiter.batch_search_to_start().is_none(),
        "one search at a time"
    );
    w.arbiter.finish_batch_search(Some(job.run()));
    assert_eq!(
        granted(&mut w.replies),
        vec![false, true, true],
        "the same as the search under the lock places"
    );
}

#[test]
fn an_outcome_computed_on_other_leases_is_searched_again() {
    let mut w = three_waiting_behind_a_filler(true);
    let queued = w.arbiter.batch_search_to_start();
    w.arbiter
        .finish_batch_search(queued.map(BatchSearchJob::run));
    // A search taken while the filler still holds the GPU (a sample's admission
    // pass asks for it): it places nobody.
    w.arbiter.record_samples(Instant::now(), &[]);
    let stale = w
        .arbiter
        .batch_search_to_start()
        .expect("a search is wanted");
    w.arbiter.release(&w.filler).unwrap();
    // The release's own pass wants a search, but the stale one is still out.
    assert!(w.arbiter.batch_search_to_start().is_none());
    w.arbiter.finish_batch_search(Some(stale.run()));
    assert_eq!(
        granted(&mut w.replies),
        vec![false, false, false],
        "an outcome from before the release is not applied"
    );
    let fresh = w
        .arbiter
        .batch_search_to_start()
        .expect("the stale outcome asks for a new search");
    w.arbiter.finish_batch_search(Some(fresh.run()));
    assert_eq!(granted(&mut w.replies), vec![false, true, true]);
}

#[test]
fn in_place_and_off_the_lock_place_alike() {
    for off in [false, true] {
        let mut w = three_waiting_behind_a_filler(off);
        w.arbiter.release(&w.filler).unwrap();
        while let Some(job) = w.arbiter.batch_search_to_start() {
            w.arbiter.finish_batch_search(Some(job.run()));
        }
        assert_eq!(
            granted(&mut w.replies),
            vec![false, true, true],
            "off={off}"
        );
    }
}

#[test]
fn a_search_that_cannot_run_leaves_the_search_in_place() {
    let mut w = three_waiting_behind_a_filler(true);
    w.arbiter.release(&w.filler).unwrap();
    let _lost = w
        .arbiter
        .batch_search_to_start()
        .expect("a search is wanted");
    w.arbiter.finish_batch_search(None);
    assert_eq!(granted(&mut w.replies), vec![false, true, true]);
    assert!(w.arbiter.batch_search_to_start().is_none());
}

#[tokio::test]
async fn a_handle_runs_the_search_off_the_lock_and_admits_the_waiters() {
    let w = three_waiting_behind_a_filler(false);
    let Waiting {
        _dir,
        arbiter,
        filler,
        replies,
    } = w;
    drop(replies);
    let handle = ArbiterHandle::new(arbiter);
    let reserve = |name: &'static str, memory: &'static str| {
        let handle = handle.clone();
        tokio::spawn(async move {
            handle
                .reserve(
                    request(name, memory, Priority::Low),
                    std::future::pending::<bool>(),
                )
                .await
        })
    };
    let five = reserve("five-again", "5Gi");
    let four = reserve("four-again", "4Gi");
    let four_too = reserve("four-too-again", "4Gi");
    // The three waiters (and the three whose replies were dropped, withdrawn).
    let deadline = Instant::now() + Duration::from_secs(30);
    while handle.status().queue.len() < 3 {
        assert!(Instant::now() < deadline, "the reserves never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    handle.release(&filler).await.unwrap();
    let bound = Duration::from_secs(30);
    let four = tokio::time::timeout(bound, four).await.expect("hang");
    let four_too = tokio::time::timeout(bound, four_too).await.expect("hang");
    assert!(matches!(four, Ok(Ok(Some(_)))), "{four:?}");
    assert!(matches!(four_too, Ok(Ok(Some(_)))), "{four_too:?}");
    assert!(!five.is_finished(), "the 5 GiB request still waits");
    assert!(handle.status().placement_times.batch_searches.count >= 1);
}
