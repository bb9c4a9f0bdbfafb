//! `gpusharectl timeline`: who held each GPU's time-slice token when, drawn from the
//! token service's recent holds as a compact text strip per GPU and as an SVG chart.
//! Pure functions of a [`TimelineReport`]; the command only fetches and writes.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use gpushare_proto::{ByteSize, LeaseId, Priority, TimelineReport, TokenHold};
use plotters::prelude::*;

use crate::render::{fit, wrap};
use crate::terminal::shown_name;

/// Columns of the text strip: one per time bucket.
pub const STRIP_COLUMNS: usize = 60;

/// The most characters of a container's name in the legend, which keeps its line within
/// the width beside the letter, priority, lease id, token time and token share.
const LEGEND_NAME: usize = 48;

#[derive(Debug, thiserror::Error)]
pub enum TimelineError {
    #[error("drawing the timeline: {0}")]
    Draw(String),
}

/// A lease as the timeline shows it: a letter, its name and priority.
#[derive(Debug, Clone, PartialEq)]
struct Shown {
    letter: char,
    container: String,
    priority: Priority,
}

/// Letters A–Z then a–z then digits, one per lease that holds the token in the
/// report, in the order the report lists them (its `leases`, then any lease only a
/// hold names); '?' past 62. A lease of `leases` without a hold in the window (the
/// demo's baseline runs, before `--since`) gets no letter: it would only take a
/// letter and a legend entry from the ones drawn.
fn letters(report: &TimelineReport) -> BTreeMap<LeaseId, Shown> {
    const ALPHABET: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let holding: std::collections::BTreeSet<&LeaseId> = report
        .gpus
        .iter()
        .flat_map(|g| &g.holds)
        .map(|h| &h.lease)
        .collect();
    let mut order: Vec<(LeaseId, String, Priority)> = report
        .leases
        .iter()
        .filter(|l| holding.contains(&l.lease))
        .map(|l| (l.lease.clone(), l.container.clone(), l.priority))
        .collect();
    for hold in report.gpus.iter().flat_map(|g| &g.holds) {
        if !order.iter().any(|(id, ..)| id == &hold.lease) {
            order.push((hold.lease.clone(), hold.container.clone(), hold.priority));
        }
    }
    order
        .into_iter()
        .enumerate()
        .map(|(i, (lease, container, priority))| {
            let letter = ALPHABET.chars().nth(i).unwrap_or('?');
            (
                lease,
                Shown {
                    letter,
                    container: shown_name(&container),
                    priority,
                },
            )
        })
        .collect()
}

/// The span the holds cover, in unix ms: (first start, last end); None without holds.
fn span(report: &TimelineReport) -> Option<(u64, u64)> {
    let holds = report.gpus.iter().flat_map(|g| &g.holds);
    let start = holds.clone().map(|h| h.start_unix_ms).min()?;
    let end = holds.map(|h| h.end_unix_ms).max()?;
    Some((start, end.max(start + 1)))
}

/// Milliseconds of `hold` inside [from, to).
fn overlap_ms(hold: &TokenHold, from: u64, to: u64) -> u64 {
    hold.end_unix_ms
        .min(to)
        .saturating_sub(hold.start_unix_ms.max(from))
}

/// One character per bucket: the letter of a lease that held the token in it, upper
/// case when the token was held at least half the bucket, lower case when less; '.'
/// when nobody held it.
///
/// Which holder a shared bucket shows is decided by credit: each lease earns the time it
/// held in the bucket, the bucket goes to the holder in it with the most credit, and that
/// one pays the bucket's held time. Holders taking turns faster than a bucket is wide
/// (the token's slices are milliseconds) thus get buckets in proportion to their token
/// time: a lease holding 41 % of every bucket shows in about 41 % of them, where "who
/// held it most" would draw its rival in every one.
fn strip(holds: &[TokenHold], shown: &BTreeMap<LeaseId, Shown>, from: u64, to: u64) -> String {
    let width = (to - from) as f64 / STRIP_COLUMNS as f64;
    let mut credit: BTreeMap<&LeaseId, i64> = BTreeMap::new();
    (0..STRIP_COLUMNS)
        .map(|c| {
            let a = from + (c as f64 * width) as u64;
            let b = (from + ((c + 1) as f64 * width) as u64).max(a + 1);
            let mut held: BTreeMap<&LeaseId, u64> = BTreeMap::new();
            for h in holds {
                let ms = overlap_ms(h, a, b);
                if ms > 0 {
                    *held.entry(&h.lease).or_default() += ms;
                }
            }
            for (lease, ms) in &held {
                *credit.entry(lease).or_default() += *ms as i64;
            }
            let total: u64 = held.values().sum();
            let chosen = held
                .iter()
                .max_by_key(|(lease, ms)| (credit.get(*lease).copied().unwrap_or(0), **ms));
            match chosen {
                None => '.',
                Some((lease, _)) => {
                    if let Some(owed) = credit.get_mut(*lease) {
                        *owed -= total as i64;
                    }
                    let letter = shown.get(*lease).map_or('?', |s| s.letter);
                    if 2 * total.min(b - a) >= b - a {
                        letter
                    } else {
                        letter.to_ascii_lowercase()
                    }
                }
            }
        })
        .collect()
}

/// Seconds with one decimal ("12.3 s").
fn seconds(ms: u64) -> String {
    format!("{:.1} s", ms as f64 / 1000.0)
}

/// The text view: per GPU a strip and, per lease that held it, its letter, name,
/// priority, token time in the span and token share of the span.
pub fn render_text(report: &TimelineReport) -> String {
    let Some((from, to)) = span(report) else {
        return wrap(
            &("no token holds recorded (no container on a time-sliced GPU yet, or none within --since)\n"
                .to_owned()
                + &render_reclaims(report, None)),
        );
    };
    let shown = letters(report);
    let mut out = format!(
        "token holds over {}, {} per column: holders get columns in proportion to their token time\n\
         (lower case: the token was held less than half the column; '.': idle)\n",
        seconds(to - from),
        crate::render::duration((to - from) / STRIP_COLUMNS as u64)
    );
    for gpu in &report.gpus {
        if gpu.holds.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "{}  |{}|",
            gpu.gpu,
            strip(&gpu.holds, &shown, from, to)
        );
        let mut held: BTreeMap<&LeaseId, u64> = BTreeMap::new();
        for h in &gpu.holds {
            *held.entry(&h.lease).or_default() += overlap_ms(h, from, to);
        }
        for (lease, ms) in held {
            let Some(s) = shown.get(lease) else { continue };
            let _ = writeln!(
                out,
                "  {} {} ({}, {})  token time {}, token share {:.0} % of the span",
                s.letter,
                fit(&s.container, LEGEND_NAME),
                s.priority,
                lease,
                seconds(ms),
                100.0 * ms as f64 / (to - from) as f64
            );
        }
    }
    wrap(&(out + &render_reclaims(report, Some(from))))
}

/// The memory reclaims, each at its time from the span's start (`from`, unix ms).
fn render_reclaims(report: &TimelineReport, from: Option<u64>) -> String {
    if report.reclaims.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "memory reclaims (low-priority leases checkpointed off the GPU for a high-priority one):\n",
    );
    for r in &report.reclaims {
        let at = match from {
            Some(from) if r.at_unix_ms >= from => format!("+{}", seconds(r.at_unix_ms - from)),
            _ => "before the span".into(),
        };
        let _ = writeln!(
            out,
            "  {at} {}: {} needed {} more: {} from {} lease(s) in {:.0} ms (bound {:.0} ms){}",
            r.gpu,
            r.lease,
            ByteSize(r.shortfall),
            ByteSize(r.bytes),
            r.victims.len(),
            r.total_ms,
            r.bound_ms,
            if r.succeeded { "" } else { ", refused" }
        );
    }
    out
}

/// A colour per lease: high priority in warm hues, low in cool ones, so the two
/// classes read apart at a glance.
fn colour(index: usize, priority: Priority) -> RGBColor {
    const WARM: [RGBColor; 4] = [
        RGBColor(214, 39, 40),
        RGBColor(255, 127, 14),
        RGBColor(227, 119, 194),
        RGBColor(188, 189, 34),
    ];
    const COOL: [RGBColor; 4] = [
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(23, 190, 207),
        RGBColor(148, 103, 189),
    ];
    match priority {
        Priority::High => WARM[index % WARM.len()],
        Priority::Low => COOL[index % COOL.len()],
    }
}

/// The SVG chart: one row per GPU, a bar per hold coloured by container, seconds
/// since the first hold on the x axis, a legend naming each container.
pub fn render_svg(report: &TimelineReport) -> Result<String, TimelineError> {
    let draw = |e: &dyn std::fmt::Display| TimelineError::Draw(e.to_string());
    let shown = letters(report);
    let (from, to) = span(report).unwrap_or((0, 1_000));
    let span_s = (to - from) as f64 / 1000.0;
    let rows = report.gpus.len().max(1);
    let mut svg = String::new();
    {
        let height = 160 + 60 * rows as u32 + 20 * shown.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (960, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| draw(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("Who held each GPU's time-slice token", ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(120)
            .build_cartesian_2d(0f64..span_s, 0f64..rows as f64)
            .map_err(|e| draw(&e))?;
        let gpu_names: Vec<String> = report
            .gpus
            .iter()
            .map(|g| g.gpu.chars().take(12).collect())
            .collect();
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("seconds since the first hold shown")
            .y_labels(rows * 2 + 1)
            .y_label_formatter(&|y| {
                let row = y.floor() as usize;
                if (y - row as f64 - 0.5).abs() < 0.01 {
                    gpu_names.get(row).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(|e| draw(&e))?;
        for (index, (lease, s)) in shown.iter().enumerate() {
            let fill = colour(index, s.priority);
            let bars: Vec<Rectangle<(f64, f64)>> = report
                .gpus
                .iter()
                .enumerate()
                .flat_map(|(row, g)| {
                    g.holds.iter().filter(|h| &h.lease == lease).map(move |h| {
                        let x0 = (h.start_unix_ms.saturating_sub(from)) as f64 / 1000.0;
                        let x1 = (h.end_unix_ms.saturating_sub(from)) as f64 / 1000.0;
                        Rectangle::new(
                            [(x0, row as f64 + 0.15), (x1, row as f64 + 0.85)],
                            fill.filled(),
                        )
                    })
                })
                .collect();
            chart
                .draw_series(bars)
                .map_err(|e| draw(&e))?
                .label(format!("{} {} ({})", s.letter, s.container, s.priority))
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], fill.filled()));
        }
        if !shown.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| draw(&e))?;
        }
        root.present().map_err(|e| draw(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::{GpuTimeline, LeaseTokenTime};

    fn hold(lease: &str, priority: Priority, start: u64, end: u64) -> TokenHold {
        TokenHold {
            lease: LeaseId(lease.into()),
            container: format!("c-{lease}"),
            priority,
            start_unix_ms: start,
            end_unix_ms: end,
        }
    }

    fn report() -> TimelineReport {
        TimelineReport {
            reclaims: Vec::new(),
            gpus: vec![GpuTimeline {
                gpu: "GPU-0".into(),
                holds: vec![
                    // The high job holds the first half, the low one the rest but a
                    // short bit (10 % of one column) at the very end.
                    hold("hi", Priority::High, 1_000, 31_000),
                    hold("lo", Priority::Low, 31_000, 59_000),
                    hold("lo", Priority::Low, 60_900, 61_000),
                ],
            }],
            leases: vec![
                LeaseTokenTime {
                    lease: LeaseId("hi".into()),
                    container: "c-hi".into(),
                    priority: Priority::High,
                    token_time_ms: 30_000,
                },
                LeaseTokenTime {
                    lease: LeaseId("lo".into()),
                    container: "c-lo".into(),
                    priority: Priority::Low,
                    token_time_ms: 28_100,
                },
            ],
        }
    }

    #[test]
    fn the_strip_has_a_letter_per_column_for_who_held_it_most() {
        let text = render_text(&report());
        let strip_line = text.lines().find(|l| l.starts_with("GPU-0")).unwrap();
        let strip = strip_line.split('|').nth(1).unwrap();
        assert_eq!(strip.chars().count(), STRIP_COLUMNS, "{text}");
        // 60 s over 60 columns: 30 of A, 28 of B, an idle one, then a little of B.
        let want = format!("{}{}.b", "A".repeat(30), "B".repeat(28));
        assert_eq!(strip, want, "{text}");
        for line in [
            "A c-hi (high, hi)  token time 30.0 s, token share 50 % of the span",
            "B c-lo (low, lo)  token time 28.1 s, token share 47 % of the span",
            "token holds over 60.0 s, 1.00 s per column: holders get columns in proportion",
        ] {
            assert!(text.contains(line), "{line:?} in\n{text}");
        }
        assert!(render_text(&TimelineReport::default()).starts_with("no token holds"));
    }

    /// Two containers taking turns far faster than a column is wide: A holds 59 ms, B
    /// 41 ms, over and over. Each column has both, A a little more; the strip must still
    /// show B in about its share of the columns, not A alone.
    #[test]
    fn a_holder_with_a_sizeable_share_shows_in_the_strip_however_fine_the_turns() {
        let mut holds = Vec::new();
        let mut t = 0;
        while t < 60_000 {
            holds.push(hold("hi", Priority::High, t, t + 59));
            holds.push(hold("lo", Priority::Low, t + 59, t + 100));
            t += 100;
        }
        let r = TimelineReport {
            gpus: vec![GpuTimeline {
                gpu: "GPU-0".into(),
                holds,
            }],
            ..Default::default()
        };
        let text = render_text(&r);
        let strip = text
            .lines()
            .find(|l| l.starts_with("GPU-0"))
            .and_then(|l| l.split('|').nth(1))
            .unwrap();
        let columns = |letter: char| strip.chars().filter(|c| *c == letter).count();
        // 41 % of 60 columns is 24.6; the turns are drawn in proportion.
        assert!(
            (23..=26).contains(&columns('B')),
            "B held 41 % of the span: {strip}"
        );
        assert_eq!(columns('A') + columns('B'), STRIP_COLUMNS, "{strip}");
        assert!(
            text.contains("B c-lo (low, lo)  token time 24.6 s, token share 41 % of the span"),
            "{text}"
        );
    }

    #[test]
    fn memory_reclaims_are_listed_at_their_time_in_the_span() {
        let mut r = report();
        assert!(!render_text(&r).contains("memory reclaims"));
        r.reclaims.push(gpushare_proto::ReclaimReport {
            lease: "hi".into(),
            gpu: "GPU-0".into(),
            shortfall: 2 << 30,
            bytes: 3 << 30,
            victims: vec!["lo".into()],
            succeeded: true,
            total_ms: 130.0,
            bound_ms: 250.0,
            at_unix_ms: 13_500,
            ..Default::default()
        });
        let text = render_text(&r);
        assert!(
            text.contains(
                "+12.5 s GPU-0: hi needed 2Gi more: 3Gi from 1 lease(s) in 130 ms (bound 250 ms)"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_lease_without_a_hold_in_the_window_gets_no_letter_nor_legend_entry() {
        let mut r = report();
        r.leases.insert(
            0,
            LeaseTokenTime {
                lease: LeaseId("baseline".into()),
                container: "c-baseline".into(),
                priority: Priority::High,
                token_time_ms: 4_000,
            },
        );
        let text = render_text(&r);
        assert!(text.contains("A c-hi (high, hi)"), "{text}");
        assert!(!text.contains("c-baseline"), "{text}");
        let svg = render_svg(&r).unwrap();
        assert!(svg.contains("A c-hi (high)") && !svg.contains("c-baseline"));
    }

    #[test]
    fn container_names_are_shown_without_their_control_characters() {
        let hostile = "evil\x1b[2J\x1b]0;owned\x07\r\nGPU 9 fake \u{9b}31m";
        let mut r = report();
        r.leases[0].container = hostile.into();
        let text = render_text(&r);
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{text:?}"
        );
        assert!(!text.lines().any(|l| l.starts_with("GPU 9")), "{text}");
        assert!(text.contains("A evil"), "{text}");
        let svg = render_svg(&r).unwrap();
        assert!(
            !svg.chars().any(|c| c.is_control() && c != '\n'),
            "the SVG is XML, where these are not even allowed"
        );
    }

    #[test]
    fn the_svg_draws_a_bar_per_hold_and_names_each_container() {
        let svg = render_svg(&report()).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80]);
        for name in ["A c-hi (high)", "B c-lo (low)", "GPU-0"] {
            assert!(svg.contains(name), "{name} missing");
        }
        // A bar per hold plus the legend's swatches and the background.
        let red = svg.matches("fill=\"#D62728\"").count();
        assert_eq!(red, 2, "one bar and one legend swatch for the high job");
        let green = svg.matches("fill=\"#2CA02C\"").count();
        assert_eq!(green, 3, "two bars and one swatch for the low job");
        // Without holds it still draws (an empty chart), never fails.
        assert!(render_svg(&TimelineReport::default())
            .unwrap()
            .starts_with("<svg"));
    }
}
