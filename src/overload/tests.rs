//! The permits and the queue together, on tokio's paused clock (no real waiting).

use super::*;
use prometheus_client::registry::Registry;

fn fixed(n: u32, max_queue: u32, max_wait_ms: u64) -> Arc<Overload> {
    let metrics = OverloadMetrics::register(&mut Registry::default());
    let settings = Settings {
        limiting: Limiting::Fixed(n),
        max_queue,
        max_wait: Duration::from_millis(max_wait_ms),
        reserve_for_higher: RESERVE_FOR_HIGHER,
    };
    Overload::new(settings, "api", &metrics)
}

/// Let the spawned tasks run until each waits.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn requests_within_the_limit_pass_at_once_and_the_next_waits_for_a_release() {
    let o = fixed(2, 10, 1000);
    let a = o.admit(0).await.expect("room");
    let _b = o.admit(0).await.expect("room");
    assert_eq!(o.status().in_flight, 2);
    let o2 = o.clone();
    let c = tokio::spawn(async move { o2.admit(0).await.map(|_| ()) });
    settle().await;
    assert_eq!(o.status().queued, 1);
    drop(a);
    assert_eq!(c.await.expect("joined"), Ok(()));
    assert_eq!(o.status().queued, 0);
    // c's permit was dropped at its task's end: only b is in flight.
    assert_eq!(o.status().in_flight, 1);
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_highest_priority_first_then_in_arrival_order() {
    let o = fixed(1, 10, 10_000);
    let first = o.admit(0).await.expect("room");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, p) in [(0, 0), (1, 10), (2, 0), (3, 5), (4, 10)] {
        let (o, order) = (o.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let permit = o.admit(p).await.expect("served");
            order.lock().expect("order").push(i);
            // Held a while, so that the next is served only after it.
            tokio::time::sleep(Duration::from_millis(1)).await;
            drop(permit);
        }));
        settle().await;
    }
    assert_eq!(o.status().queued, 5);
    drop(first);
    for t in tasks {
        t.await.expect("joined");
    }
    assert_eq!(*order.lock().expect("order"), [1, 4, 3, 0, 2]);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_sheds_the_lowest_priority_and_a_newcomer_of_no_higher_priority() {
    let o = fixed(1, 2, 10_000);
    let _held = o.admit(0).await.expect("room");
    let spawn = |p: u32| {
        let o = o.clone();
        tokio::spawn(async move { o.admit(p).await.map(|_| ()) })
    };
    let free1 = spawn(0);
    settle().await;
    let free2 = spawn(0);
    settle().await;
    // Full of priority 0: another free request is shed at once.
    assert_eq!(o.admit(0).await.err(), Some(Shed::Full));
    // A pro request takes the youngest free one's place.
    let pro = spawn(10);
    settle().await;
    assert_eq!(free2.await.expect("joined"), Err(Shed::Evicted));
    assert_eq!(o.status().queued, 2);
    assert_eq!(o.status().shed, 2);
    drop(_held);
    assert_eq!(pro.await.expect("joined"), Ok(()));
    assert_eq!(free1.await.expect("joined"), Ok(()));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_is_shed_after_max_wait_and_leaves_the_queue() {
    let o = fixed(1, 10, 500);
    let _held = o.admit(0).await.expect("room");
    let started = tokio::time::Instant::now();
    assert_eq!(o.admit(0).await.err(), Some(Shed::Waited));
    assert_eq!(started.elapsed(), Duration::from_millis(500));
    assert_eq!(o.status().queued, 0);
    assert_eq!(o.status().shed, 1);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_client_leaves_is_removed_and_its_place_not_leaked() {
    let o = fixed(1, 10, 10_000);
    let held = o.admit(0).await.expect("room");
    let o2 = o.clone();
    let gone = tokio::spawn(async move { o2.admit(0).await.map(|_| ()) });
    settle().await;
    assert_eq!(o.status().queued, 1);
    gone.abort();
    settle().await;
    assert_eq!(o.status().queued, 0);
    drop(held);
    assert_eq!(o.status().in_flight, 0);
    // The limit is whole: the next request passes at once.
    let _again = o.admit(0).await.expect("room");
    assert_eq!(o.status().in_flight, 1);
}

#[tokio::test(start_paused = true)]
async fn a_permit_sent_to_a_waiter_that_just_left_comes_back() {
    let o = fixed(1, 10, 10_000);
    let held = o.admit(0).await.expect("room");
    let o2 = o.clone();
    let gone = tokio::spawn(async move {
        let _p = o2.admit(0).await;
        std::future::pending::<()>().await;
    });
    settle().await;
    // Released while the waiter is there: its permit is sent; then its task ends.
    drop(held);
    gone.abort();
    settle().await;
    assert_eq!(o.status().in_flight, 0);
    assert_eq!(o.status().queued, 0);
}

#[tokio::test(start_paused = true)]
async fn no_queue_sheds_at_once_past_the_limit() {
    let o = fixed(1, 0, 10_000);
    let _held = o.admit(0).await.expect("room");
    assert_eq!(o.admit(10).await.err(), Some(Shed::Full));
}

#[tokio::test(start_paused = true)]
async fn an_adaptive_pool_counts_answered_permits_as_samples() {
    let metrics = OverloadMetrics::register(&mut Registry::default());
    let settings = Settings {
        limiting: Limiting::Adaptive(Adaptive {
            min_limit: 4,
            max_limit: 100,
            probe_interval: Duration::from_secs(30),
        }),
        max_queue: 10,
        max_wait: Duration::from_secs(1),
        reserve_for_higher: RESERVE_FOR_HIGHER,
    };
    let o = Overload::new(settings, "api", &metrics);
    assert_eq!(o.status().limit, limit::INITIAL);
    assert_eq!(o.status().mode, "adaptive");
    let p = o.admit(0).await.expect("room");
    p.answered();
    assert_eq!(o.status().in_flight, 0);
    let s = lock(&o.state);
    let Control::Adaptive(g) = &s.control else {
        panic!("adaptive")
    };
    assert!(
        g.floor().is_some(),
        "the answered permit was a low-concurrency sample"
    );
}

#[tokio::test(start_paused = true)]
async fn slow_low_priority_work_leaves_a_place_for_a_higher_priority() {
    let o = fixed(4, 10, 1000);
    o.levels(&[0, 10]);
    // Priority 0 may hold 3 of 4 (25% kept for 10).
    let free = taken(&o, 0, 3).await;
    let o2 = o.clone();
    let fourth_free = tokio::spawn(async move { o2.admit(0).await.map(|_| ()) });
    settle().await;
    assert_eq!(o.status().queued, 1, "the fourth free request waits");
    assert_eq!(o.status().in_flight, 3);
    // A pro request finds the place kept for it at once, the free one still waiting.
    let pro = o.admit(10).await.expect("the reserved place");
    assert_eq!(o.status().in_flight, 4);
    // When the pro request ends, the free waiter is still over its share: it waits on,
    // and the next pro request again goes at once.
    drop(pro);
    settle().await;
    assert_eq!(o.status().queued, 1);
    let _pro_again = o.admit(10).await.expect("the reserved place again");
    drop(free);
    assert_eq!(fourth_free.await.expect("joined"), Ok(()));
}

#[tokio::test(start_paused = true)]
async fn the_highest_priority_may_take_every_place() {
    let o = fixed(4, 10, 1000);
    o.levels(&[0, 10]);
    let _pro = taken(&o, 10, 4).await;
    assert_eq!(o.status().in_flight, 4);
    assert_eq!(o.admit(10).await.err(), Some(Shed::Waited));
}

#[tokio::test(start_paused = true)]
async fn shares_nest_so_a_middle_priority_cannot_spend_the_top_ones_reserve() {
    // Limit 16, levels 0, 10, 20: 0 holds at most 9, 0 and 10 together at most 12.
    let o = fixed(16, 0, 1000);
    o.levels(&[20, 0, 10]);
    let _low = taken(&o, 0, 5).await;
    let _mid = taken(&o, 10, 7).await;
    assert_eq!(o.status().in_flight, 12);
    // 0 holds 5 of its 9, but 0 and 10 together hold 12: neither may take another.
    assert_eq!(o.admit(0).await.err(), Some(Shed::Full));
    assert_eq!(o.admit(10).await.err(), Some(Shed::Full));
    let _top = taken(&o, 20, 4).await;
    assert_eq!(o.status().in_flight, 16);
}

#[tokio::test(start_paused = true)]
async fn no_reserve_is_kept_at_zero_percent() {
    let metrics = OverloadMetrics::register(&mut Registry::default());
    let settings = Settings {
        limiting: Limiting::Fixed(4),
        max_queue: 0,
        max_wait: Duration::from_secs(1),
        reserve_for_higher: 0,
    };
    let o = Overload::new(settings, "api", &metrics);
    o.levels(&[0, 10]);
    let _free = taken(&o, 0, 4).await;
    assert_eq!(o.status().in_flight, 4);
}

/// `n` permits of `priority` taken at once (each must fit).
async fn taken(o: &Arc<Overload>, priority: u32, n: usize) -> Vec<Permit> {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(o.admit(priority).await.expect("room"));
    }
    held
}
