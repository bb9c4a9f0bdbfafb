//! The time-slicing rules of one GPU, as a pure function of its queues and the clock.
//!
//! The GPU executes one operation at a time. Each context has one FIFO of operations (kernels and
//! copies with a duration, and zero-length markers such as event records). When only one context
//! has work it runs undisturbed; when several do, the GPU gives the resident context a slice
//! (about 1 ms), then saves it and loads the next context with work in round-robin order, paying
//! the switch cost. A kernel longer than the slice is preempted and resumed later, as compute
//! preemption does on real hardware. A context whose queue runs dry gives up the rest of its
//! slice at once (the hardware does not idle while others wait).
//!
//! Markers at the head of a queue complete as soon as everything before them has: an event
//! recorded behind finished work is complete even while another context holds the GPU. That is
//! what makes event timestamps exact for whoever measures kernel completions.

/// `Engine::resident` / `switching_to` when no context is meant.
pub const NO_CONTEXT: u32 = u32::MAX;

/// Where a context's FIFO stands: `next` operations have completed, and the head (operation
/// `next`) has run for `progress_ns`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    pub next: u64,
    pub progress_ns: u64,
}

/// Read access to the submitted operations, indexed by context and position in its FIFO.
pub trait OpSource {
    /// Number of context slots (slots without work simply have no operations).
    fn contexts(&self) -> usize;
    /// Duration of operation `index` of context `ctx`, or `None` if it has not been submitted.
    fn duration_ns(&self, ctx: usize, index: u64) -> Option<u64>;
    /// Earliest instant operation `index` of `ctx` may start: a kernel reaches the device a
    /// launch latency after its submission. Until then it is not work the GPU can run.
    fn ready_ns(&self, _ctx: usize, _index: u64) -> u64 {
        0
    }
}

/// The scalar state of one GPU's execution engine.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Engine {
    /// The model's time: everything before it has been decided.
    pub now_ns: u64,
    /// The context whose state is loaded on the GPU.
    pub resident: u32,
    /// Target of the context switch in progress, or `NO_CONTEXT`.
    pub switching_to: u32,
    pub switch_left_ns: u64,
    /// Time the resident context has run in its current slice, counted only while others wait.
    pub slice_used_ns: u64,
    /// Number of context switches so far.
    pub switches: u64,
}

impl Engine {
    pub fn new(now_ns: u64) -> Engine {
        Engine {
            now_ns,
            resident: NO_CONTEXT,
            switching_to: NO_CONTEXT,
            switch_left_ns: 0,
            slice_used_ns: 0,
            switches: 0,
        }
    }

    /// A context is gone (destroyed, or its process died): the engine stops referring to it.
    pub fn forget_context(&mut self, ctx: usize) {
        if self.resident == ctx as u32 {
            self.resident = NO_CONTEXT;
            self.slice_used_ns = 0;
        }
        if self.switching_to == ctx as u32 {
            self.switching_to = NO_CONTEXT;
            self.switch_left_ns = 0;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceParams {
    pub slice_ns: u64,
    pub switch_ns: u64,
}

/// What happened while advancing, in time order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Context `ctx` executed its operation `index` on the GPU over `[from_ns, to_ns)`.
    Ran {
        ctx: usize,
        index: u64,
        from_ns: u64,
        to_ns: u64,
    },
    /// Operation `index` of context `ctx` finished at `at_ns`.
    Completed { ctx: usize, index: u64, at_ns: u64 },
    /// The GPU started switching to context `to`.
    SwitchStarted { to: usize, at_ns: u64 },
}

fn head_remaining(src: &impl OpSource, cursors: &[Cursor], ctx: usize) -> Option<u64> {
    let c = cursors[ctx];
    src.duration_ns(ctx, c.next)
        .map(|d| d.saturating_sub(c.progress_ns))
}

/// The head of `ctx`'s FIFO, if it has reached the device by `now`.
fn head_ready(src: &impl OpSource, cursors: &[Cursor], ctx: usize, now: u64) -> Option<u64> {
    head_remaining(src, cursors, ctx).filter(|_| src.ready_ns(ctx, cursors[ctx].next) <= now)
}

fn has_work(src: &impl OpSource, cursors: &[Cursor], ctx: usize, now: u64) -> bool {
    // Leading markers are drained before this is asked, so any head is real work.
    head_ready(src, cursors, ctx, now).is_some()
}

/// The earliest instant after `now` at which a head still in flight to the device arrives.
fn next_arrival(src: &impl OpSource, cursors: &[Cursor], now: u64) -> Option<u64> {
    (0..src.contexts())
        .filter(|&c| head_remaining(src, cursors, c).is_some())
        .map(|c| src.ready_ns(c, cursors[c].next))
        .filter(|&t| t > now)
        .min()
}

/// The first context after `after` (cyclically, `after` itself last) that has work.
fn next_with_work(src: &impl OpSource, cursors: &[Cursor], after: u32, now: u64) -> Option<usize> {
    let n = src.contexts();
    let start = if after == NO_CONTEXT {
        0
    } else {
        after as usize + 1
    };
    (0..n)
        .map(|k| (start + k) % n)
        .find(|&c| has_work(src, cursors, c, now))
}

/// Brings the engine from `engine.now_ns` to `until_ns`, executing the queued operations under
/// the slicing rules and reporting what happened to `observe`.
pub fn advance(
    engine: &mut Engine,
    src: &impl OpSource,
    cursors: &mut [Cursor],
    params: SliceParams,
    until_ns: u64,
    observe: &mut impl FnMut(Progress),
) {
    let n = src.contexts();
    debug_assert!(cursors.len() >= n);
    loop {
        let now = engine.now_ns;
        for ctx in 0..n {
            while head_ready(src, cursors, ctx, now) == Some(0) {
                observe(Progress::Completed {
                    ctx,
                    index: cursors[ctx].next,
                    at_ns: now,
                });
                cursors[ctx] = Cursor {
                    next: cursors[ctx].next + 1,
                    progress_ns: 0,
                };
            }
        }
        if now >= until_ns {
            return;
        }
        if engine.switching_to != NO_CONTEXT {
            let step = engine.switch_left_ns.min(until_ns - now);
            engine.now_ns += step;
            engine.switch_left_ns -= step;
            if engine.switch_left_ns == 0 {
                engine.resident = engine.switching_to;
                engine.switching_to = NO_CONTEXT;
                engine.slice_used_ns = 0;
            }
            continue;
        }
        let resident = engine.resident;
        // Work arriving later changes who waits: nothing runs past that instant in one step.
        let arrival = next_arrival(src, cursors, now);
        if resident != NO_CONTEXT && has_work(src, cursors, resident as usize, now) {
            let r = resident as usize;
            let others_wait = (0..n).any(|c| c != r && has_work(src, cursors, c, now));
            if others_wait && engine.slice_used_ns >= params.slice_ns {
                let next =
                    next_with_work(src, cursors, resident, now).expect("another context has work");
                start_switch(engine, params, next, observe);
                continue;
            }
            let budget = if others_wait {
                params.slice_ns - engine.slice_used_ns
            } else {
                u64::MAX
            };
            let remaining = head_remaining(src, cursors, r).expect("resident has work");
            let run = remaining
                .min(budget)
                .min(until_ns - now)
                .min(arrival.map_or(u64::MAX, |t| t - now));
            cursors[r].progress_ns += run;
            engine.now_ns += run;
            observe(Progress::Ran {
                ctx: r,
                index: cursors[r].next,
                from_ns: now,
                to_ns: now + run,
            });
            // Alone on the GPU, a context is never preempted: its slice only starts counting
            // once someone else waits.
            engine.slice_used_ns = if others_wait {
                engine.slice_used_ns + run
            } else {
                0
            };
            if run == remaining {
                observe(Progress::Completed {
                    ctx: r,
                    index: cursors[r].next,
                    at_ns: engine.now_ns,
                });
                cursors[r] = Cursor {
                    next: cursors[r].next + 1,
                    progress_ns: 0,
                };
            }
        } else {
            match next_with_work(src, cursors, resident, now) {
                // Idle until the next launch reaches the device.
                None if arrival.is_some_and(|t| t < until_ns) => {
                    engine.now_ns = arrival.expect("checked");
                    engine.slice_used_ns = 0;
                }
                None => {
                    engine.now_ns = until_ns;
                    engine.slice_used_ns = 0;
                    return;
                }
                // A GPU that has never run anything has no state to save.
                Some(next) if resident == NO_CONTEXT => {
                    engine.resident = next as u32;
                    engine.slice_used_ns = 0;
                }
                Some(next) => start_switch(engine, params, next, observe),
            }
        }
    }
}

fn start_switch(
    engine: &mut Engine,
    params: SliceParams,
    to: usize,
    observe: &mut impl FnMut(Progress),
) {
    engine.switches += 1;
    observe(Progress::SwitchStarted {
        to,
        at_ns: engine.now_ns,
    });
    engine.slice_used_ns = 0;
    if params.switch_ns == 0 {
        engine.resident = to as u32;
    } else {
        engine.switching_to = to as u32;
        engine.switch_left_ns = params.switch_ns;
    }
}

/// When operation `index` of `ctx` would complete if nobody submitted anything more, looking at
/// most until `horizon_ns`. New work can only delay it, so waiters may sleep until then.
pub fn predict_completion(
    engine: &Engine,
    src: &impl OpSource,
    cursors: &[Cursor],
    params: SliceParams,
    ctx: usize,
    index: u64,
    horizon_ns: u64,
) -> Option<u64> {
    if cursors[ctx].next > index {
        return Some(engine.now_ns);
    }
    let mut engine = *engine;
    let mut cursors = cursors.to_vec();
    let mut done = None;
    advance(
        &mut engine,
        src,
        &mut cursors,
        params,
        horizon_ns,
        &mut |p| {
            if let Progress::Completed {
                ctx: c,
                index: i,
                at_ns,
            } = p
            {
                if c == ctx && i == index && done.is_none() {
                    done = Some(at_ns);
                }
            }
        },
    );
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;

    /// Queues held in vectors, for table tests.
    struct Fifos(Vec<Vec<u64>>);

    impl OpSource for Fifos {
        fn contexts(&self) -> usize {
            self.0.len()
        }
        fn duration_ns(&self, ctx: usize, index: u64) -> Option<u64> {
            self.0[ctx].get(index as usize).copied()
        }
    }

    struct Run {
        completions: Vec<(usize, u64, u64)>,
        busy: Vec<u64>,
        engine: Engine,
        cursors: Vec<Cursor>,
    }

    fn run(fifos: &Fifos, params: SliceParams, until: u64) -> Run {
        let mut engine = Engine::new(0);
        let mut cursors = vec![Cursor::default(); fifos.contexts()];
        let mut completions = vec![];
        let mut busy = vec![0; fifos.contexts()];
        advance(
            &mut engine,
            fifos,
            &mut cursors,
            params,
            until,
            &mut |p| match p {
                Progress::Completed { ctx, index, at_ns } => completions.push((ctx, index, at_ns)),
                Progress::Ran {
                    ctx,
                    from_ns,
                    to_ns,
                    ..
                } => busy[ctx] += to_ns - from_ns,
                Progress::SwitchStarted { .. } => {}
            },
        );
        Run {
            completions,
            busy,
            engine,
            cursors,
        }
    }

    const P: SliceParams = SliceParams {
        slice_ns: MS,
        switch_ns: 100 * US,
    };

    /// Queues whose operations reach the device at given instants: (duration, ready).
    struct Arriving(Vec<Vec<(u64, u64)>>);

    impl OpSource for Arriving {
        fn contexts(&self) -> usize {
            self.0.len()
        }
        fn duration_ns(&self, ctx: usize, index: u64) -> Option<u64> {
            self.0[ctx].get(index as usize).map(|op| op.0)
        }
        fn ready_ns(&self, ctx: usize, index: u64) -> u64 {
            self.0[ctx].get(index as usize).map_or(0, |op| op.1)
        }
    }

    fn run_arriving(src: &Arriving, until: u64) -> Vec<(usize, u64, u64)> {
        let mut engine = Engine::new(0);
        let mut cursors = vec![Cursor::default(); src.contexts()];
        let mut completions = vec![];
        advance(&mut engine, src, &mut cursors, P, until, &mut |p| {
            if let Progress::Completed { ctx, index, at_ns } = p {
                completions.push((ctx, index, at_ns));
            }
        });
        completions
    }

    #[test]
    fn a_kernel_starts_no_earlier_than_it_reaches_the_device() {
        type Queues = Vec<Vec<(u64, u64)>>;
        type Completions = Vec<(usize, u64, u64)>;
        let table: &[(&str, Queues, Completions)] = &[
            (
                "idle GPU: start = arrival",
                vec![vec![(MS, 4 * US)]],
                vec![(0, 0, MS + 4 * US)],
            ),
            (
                "arrived while the previous one ran: no gap",
                vec![vec![(MS, 4 * US), (MS, 10 * US)]],
                vec![(0, 0, MS + 4 * US), (0, 1, 2 * MS + 4 * US)],
            ),
            (
                "arrives after the GPU ran dry: idle until then",
                vec![vec![(MS, 0), (MS, 3 * MS)]],
                vec![(0, 0, MS), (0, 1, 4 * MS)],
            ),
            (
                // B arrives at 500 us: from then on A's slice counts, and at 1.5 ms the GPU
                // switches (100 us) to B, which runs its 200 us kernel.
                "a late neighbour starts the slice clock when it arrives",
                vec![vec![(10 * MS, 0)], vec![(200 * US, 500 * US)]],
                vec![
                    (1, 0, 1_500 * US + 100 * US + 200 * US),
                    (0, 0, 10 * MS + 200 * US + 200 * US),
                ],
            ),
        ];
        for (what, queues, want) in table {
            assert_eq!(
                &run_arriving(&Arriving(queues.clone()), 100 * MS),
                want,
                "{what}"
            );
        }
    }

    #[test]
    fn alone_a_context_runs_back_to_back() {
        let r = run(&Fifos(vec![vec![MS, 2 * MS, 500 * US]]), P, 10 * MS);
        assert_eq!(
            r.completions,
            vec![(0, 0, MS), (0, 1, 3 * MS), (0, 2, 3 * MS + 500 * US)]
        );
        assert_eq!(r.engine.switches, 0);
        assert_eq!(r.busy, vec![3_500 * US]);
        assert_eq!(r.engine.now_ns, 10 * MS);
    }

    #[test]
    fn two_saturating_contexts_alternate_slices_with_switch_cost() {
        let r = run(&Fifos(vec![vec![10 * MS], vec![10 * MS]]), P, 100 * MS);
        // A round is two slices and two switches: 2.2 ms. A finishes its 10th slice in round 10.
        let a_done = 9 * 2_200 * US + MS;
        let b_done = a_done + 100 * US + MS;
        assert_eq!(r.completions, vec![(0, 0, a_done), (1, 0, b_done)]);
        assert_eq!(r.busy, vec![10 * MS, 10 * MS]);
        assert_eq!(r.engine.switches, 19);
    }

    #[test]
    fn long_kernel_is_preempted_and_resumed() {
        // A 3 ms kernel against a stream of 100 us kernels: it gets 1 ms per round, not all at once.
        let r = run(&Fifos(vec![vec![3 * MS], vec![100 * US; 40]]), P, 100 * MS);
        let a_done = r.completions.iter().find(|c| c.0 == 0).unwrap().2;
        let b_first_after_1ms = r.completions.iter().find(|c| c.0 == 1).unwrap().2;
        assert_eq!(b_first_after_1ms, MS + 100 * US + 100 * US);
        assert_eq!(a_done, 3 * MS + 2 * (MS + 200 * US));
    }

    #[test]
    fn drained_context_yields_the_rest_of_its_slice() {
        let r = run(&Fifos(vec![vec![300 * US], vec![2 * MS]]), P, 100 * MS);
        assert_eq!(
            r.completions,
            vec![(0, 0, 300 * US), (1, 0, 300 * US + 100 * US + 2 * MS)]
        );
        assert_eq!(r.engine.switches, 1);
    }

    #[test]
    fn markers_complete_when_the_work_before_them_has() {
        // Context 1 holds only a marker; it completes at once although context 0 is running.
        let r = run(&Fifos(vec![vec![2 * MS, 0], vec![0]]), P, 10 * MS);
        assert_eq!(
            r.completions,
            vec![(1, 0, 0), (0, 0, 2 * MS), (0, 1, 2 * MS)]
        );
        assert_eq!(r.engine.switches, 0);
    }

    #[test]
    fn zero_switch_cost_splits_time_exactly() {
        let params = SliceParams {
            slice_ns: MS,
            switch_ns: 0,
        };
        let r = run(
            &Fifos(vec![vec![5 * MS], vec![5 * MS], vec![5 * MS]]),
            params,
            7 * MS,
        );
        // Round robin 0,1,2,0,1,2,0: context 0 has had 3 slices, the others 2.
        assert_eq!(r.busy, vec![3 * MS, 2 * MS, 2 * MS]);
        assert!(r.completions.is_empty());
        assert_eq!(
            r.cursors[0],
            Cursor {
                next: 0,
                progress_ns: 3 * MS
            }
        );
    }

    #[test]
    fn idle_gpu_switching_back_to_the_resident_costs_nothing() {
        // Context 0 works, the GPU idles, then context 0 works again: no switch.
        let fifos = Fifos(vec![vec![MS, MS]]);
        let mut engine = Engine::new(0);
        let mut cursors = vec![Cursor::default()];
        let one = Fifos(vec![vec![MS]]);
        advance(&mut engine, &one, &mut cursors, P, 5 * MS, &mut |_| {});
        let mut done = vec![];
        advance(&mut engine, &fifos, &mut cursors, P, 10 * MS, &mut |p| {
            if let Progress::Completed { at_ns, .. } = p {
                done.push(at_ns)
            }
        });
        assert_eq!(done, vec![6 * MS]);
        assert_eq!(engine.switches, 0);
    }

    /// Small deterministic generator so the step-invariance test needs no crate.
    fn lcg(state: &mut u64) -> u64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *state >> 33
    }

    #[test]
    fn advancing_in_many_steps_equals_one_step() {
        let mut seed = 42;
        for _ in 0..50 {
            let fifos = Fifos(
                (0..3)
                    .map(|_| {
                        (0..20)
                            .map(|_| {
                                [0, 50 * US, 400 * US, 1_700 * US][lcg(&mut seed) as usize % 4]
                            })
                            .collect()
                    })
                    .collect(),
            );
            let whole = run(&fifos, P, 200 * MS);
            let mut engine = Engine::new(0);
            let mut cursors = vec![Cursor::default(); 3];
            let mut completions = vec![];
            let mut t = 0;
            while t < 200 * MS {
                t = (t + lcg(&mut seed) % (3 * MS)).min(200 * MS);
                advance(&mut engine, &fifos, &mut cursors, P, t, &mut |p| {
                    if let Progress::Completed { ctx, index, at_ns } = p {
                        completions.push((ctx, index, at_ns));
                    }
                });
            }
            assert_eq!(completions, whole.completions);
            assert_eq!(engine, whole.engine);
        }
    }

    #[test]
    fn prediction_matches_the_real_run() {
        let fifos = Fifos(vec![vec![10 * MS], vec![10 * MS]]);
        let engine = Engine::new(0);
        let cursors = vec![Cursor::default(); 2];
        let predicted = predict_completion(&engine, &fifos, &cursors, P, 1, 0, 100 * MS);
        let r = run(&fifos, P, 100 * MS);
        assert_eq!(predicted, Some(r.completions[1].2));
        assert_eq!(
            predict_completion(&engine, &fifos, &cursors, P, 1, 0, 5 * MS),
            None
        );
    }

    #[test]
    fn forgetting_a_context_mid_switch_leaves_the_engine_consistent() {
        let fifos = Fifos(vec![vec![5 * MS], vec![5 * MS]]);
        let mut engine = Engine::new(0);
        let mut cursors = vec![Cursor::default(); 2];
        advance(
            &mut engine,
            &fifos,
            &mut cursors,
            P,
            MS + 50 * US,
            &mut |_| {},
        );
        assert_eq!(engine.switching_to, 1);
        engine.forget_context(1);
        let only_a = Fifos(vec![vec![5 * MS], vec![]]);
        let mut done = None;
        advance(&mut engine, &only_a, &mut cursors, P, 20 * MS, &mut |p| {
            if let Progress::Completed { at_ns, .. } = p {
                done = Some(at_ns)
            }
        });
        // The aborted switch cost its first 50 us; context 0 is resident again without a switch.
        assert_eq!(done, Some(MS + 50 * US + 4 * MS));
    }
}
