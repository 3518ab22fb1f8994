package hotplug

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func TestJudgeReservation(t *testing.T) {
	cfg := Config{ReservationFresh: 5 * time.Second, ReservationTTL: 30 * time.Second}
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	ago := func(d time.Duration) time.Time { return now.Add(-d) }
	for _, tc := range []struct {
		name  string
		r     Reservation
		live  []string
		want  reserveAction
		until time.Time
	}{
		{"none", Reservation{}, nil, reserveTake, time.Time{}},
		{"none, but another VM holds it", Reservation{}, []string{"vm2"}, reserveHeld, time.Time{}},
		{"ours, fresh", Reservation{VM: "vm1", Holder: "me", At: ago(time.Second)}, nil, reserveUse, time.Time{}},
		{"ours, written ahead of our clock", Reservation{VM: "vm1", Holder: "me", At: now.Add(time.Second)}, nil, reserveUse, time.Time{}},
		{"ours, aging", Reservation{VM: "vm1", Holder: "me", At: ago(5 * time.Second)}, nil, reserveRenew, time.Time{}},
		{"ours, long expired", Reservation{VM: "vm1", Holder: "me", At: ago(time.Hour)}, nil, reserveRenew, time.Time{}},
		{"ours, but another VM holds it", Reservation{VM: "vm1", Holder: "me", At: ago(time.Second)}, []string{"vm2"}, reserveHeld, time.Time{}},
		{"another VM's, fresh", Reservation{VM: "vm2", Holder: "other", At: ago(29 * time.Second)}, nil, reserveHeld, now.Add(time.Second)},
		{"another VM's by us, fresh", Reservation{VM: "vm2", Holder: "me", At: ago(time.Second)}, nil, reserveHeld, now.Add(29 * time.Second)},
		{"another VM's, expired", Reservation{VM: "vm2", Holder: "other", At: ago(30 * time.Second)}, nil, reserveTakeOver, time.Time{}},
		{"another VM's, expired, and it holds the volume", Reservation{VM: "vm2", Holder: "other", At: ago(time.Hour)}, []string{"vm2"}, reserveHeld, time.Time{}},
		{"another VM's, written ahead of our clock", Reservation{VM: "vm2", Holder: "other", At: now.Add(time.Minute)}, nil, reserveHeld, now.Add(90 * time.Second)},
		{"this VM's by another controller, fresh", Reservation{VM: "vm1", Holder: "other", At: ago(10 * time.Second)}, nil, reserveWait, now.Add(20 * time.Second)},
		{"this VM's by another controller, expired", Reservation{VM: "vm1", Holder: "other", At: ago(31 * time.Second)}, nil, reserveTakeOver, time.Time{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := judgeReservation(now, cfg, "vm1", "me", tc.r, tc.live)
			if got.action != tc.want || !got.until.Equal(tc.until) {
				t.Fatalf("got %s until %v, want %s until %v", got.action, got.until, tc.want, tc.until)
			}
		})
	}
}

// Two queues over one host are two controller processes: neither sees the
// other's intents or unobserved writes, and their informers lag. Publishes
// of one volume to two VMs, one through each, at the same moment: exactly
// one may win, the volume must never be in both VMs' specs, and once the
// winner lets go the other VM gets it.
func TestTwoQueuesNeverAttachOneVolumeToTwoVMs(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	f.lag = 50 * time.Millisecond
	queues := make([]*Queue, 2)
	for i, id := range []string{"controller-1", "controller-2"} {
		cfg := fastConfig()
		cfg.Identity = id
		queues[i], _ = startQueue(t, f, cfg)
	}
	watchDoubleAttach(t, f, "pvc-a")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vms := []string{"vm1", "vm2"}
	for round := range 10 {
		vmOf := func(i int) string { return vms[(i+round)%2] }
		start := make(chan struct{})
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for i, q := range queues {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				errs[i] = q.Attach(ctx, vmOf(i), "pvc-a", true)
			}()
		}
		close(start)
		wg.Wait()
		var won []int
		for i, err := range errs {
			var held *HeldError
			switch {
			case err == nil:
				won = append(won, i)
			case errors.As(err, &held):
				if held.VM != vmOf(1-i) {
					t.Errorf("round %d: attach to %s refused naming %s, want %s", round, vmOf(i), held.VM, vmOf(1-i))
				}
			default:
				t.Fatalf("round %d: attach to %s answered %v", round, vmOf(i), err)
			}
		}
		if len(won) != 1 {
			t.Fatalf("round %d: %d attaches succeeded (%v), want exactly 1", round, len(won), errs)
		}
		w, l := won[0], 1-won[0]
		if err := queues[w].Detach(ctx, vmOf(w), "pvc-a"); err != nil {
			t.Fatalf("round %d: detach from %s: %v", round, vmOf(w), err)
		}
		if r := f.reservation("pvc-a"); !r.IsZero() {
			t.Fatalf("round %d: detach answered while the volume is still reserved: %+v", round, r)
		}
		// The other process learns of the detach from its own informers,
		// which lag: until then its in-process fence still refuses.
		testwait.For(t, "the other process to see the volume leave "+vmOf(w), 10*time.Second, func() bool {
			return len(queues[l].Holders("pvc-a")) == 0
		})
		if err := queues[l].Attach(ctx, vmOf(l), "pvc-a", true); err != nil {
			t.Fatalf("round %d: attach to %s once %s let go: %v", round, vmOf(l), vmOf(w), err)
		}
		if err := queues[l].Detach(ctx, vmOf(l), "pvc-a"); err != nil {
			t.Fatalf("round %d: detach from %s: %v", round, vmOf(l), err)
		}
	}
}

// reservedBy puts a reservation on the fake host, as another controller
// process would have left it.
func (f *fakeKubeVirt) reservedBy(claim string, r Reservation) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p := f.pvcLocked(claim)
	p.version++
	p.reserved = r
}

func reservingConfig() Config {
	cfg := fastConfig()
	cfg.Identity = "controller-1"
	cfg.RequestTimeout = 300 * time.Millisecond
	cfg.ReservationFresh = 100 * time.Millisecond
	cfg.ReservationTTL = time.Second
	return cfg
}

// A reservation another controller left for another VM fences the volume
// until it expires, even though no VM holds it yet: that controller's write
// may still be on its way. Once expired, it is taken over.
func TestAnotherVMsReservationFencesUntilItExpires(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	cfg := reservingConfig()
	q, _ := startQueue(t, f, cfg)
	watchDoubleAttach(t, f, "pvc-a")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	fresh := Reservation{VM: "vm2", Holder: "controller-2", At: time.Now()}
	f.reservedBy("pvc-a", fresh)
	var held *HeldError
	if err := q.Attach(ctx, "vm1", "pvc-a", true); !errors.As(err, &held) || held.VM != "vm2" || !strings.Contains(err.Error(), "reserved") {
		t.Fatalf("attach under another VM's fresh reservation answered %v, want a HeldError naming vm2's reservation", err)
	}
	if h := f.specHolders("pvc-a"); len(h) > 0 {
		t.Fatalf("volume written to %v under another VM's reservation", h)
	}

	f.reservedBy("pvc-a", Reservation{VM: "vm2", Holder: "controller-2", At: time.Now().Add(-cfg.ReservationTTL)})
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatalf("attach once the other reservation expired: %v", err)
	}
	if r := f.reservation("pvc-a"); r.VM != "vm1" || r.Holder != "controller-1" {
		t.Fatalf("reservation after the takeover: %+v, want vm1 by controller-1", r)
	}
}

// Another controller's fresh reservation for the same VM is waited out, not
// refused and not overwritten: that controller could release it while our
// write is on its way. The attach goes ahead once it expires.
func TestSameVMReservationOfAnotherControllerIsWaitedOut(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	cfg := reservingConfig()
	q, _ := startQueue(t, f, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	theirs := Reservation{VM: "vm1", Holder: "controller-2", At: time.Now()}
	f.reservedBy("pvc-a", theirs)
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatalf("attach: %v", err)
	}
	r := f.reservation("pvc-a")
	if r.Holder != "controller-1" || r.At.Before(theirs.At.Add(cfg.ReservationTTL)) {
		t.Fatalf("reservation %+v: taken before the other controller's expired at %v", r, theirs.At.Add(cfg.ReservationTTL))
	}
}

// An attach the host rejects (nothing was written) releases the reservation
// it took, so the next VM does not wait for it to expire.
func TestRejectedAttachReleasesItsReservation(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	f.override = func(_ string, c Change) (Outcome, bool) {
		if c.Volume == "pvc-denied" {
			return Outcome{Result: Rejected, Err: errors.New("admission webhook denied the request")}, true
		}
		return Outcome{}, false
	}
	q, _ := startQueue(t, f, reservingConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var rejected *RejectedError
	if err := q.Attach(ctx, "vm1", "pvc-denied", true); !errors.As(err, &rejected) {
		t.Fatalf("attach answered %v, want rejected", err)
	}
	if r := f.reservation("pvc-denied"); !r.IsZero() {
		t.Fatalf("rejected attach left its reservation: %+v", r)
	}
	if h := f.specHolders("pvc-denied"); !slices.Equal(h, nil) {
		t.Fatalf("rejected volume in %v", h)
	}
}

// A detach that finds nothing on the VM still releases a reservation this
// process left for that VM, here one of a VM whose VM and VMI went away, and
// answers only once it did: a caller moving the volume to another VM right
// after the answer must not find it reserved here (it would be refused as
// held elsewhere until the reservation expired).
func TestDetachOfNothingReleasesTheReservation(t *testing.T) {
	f := newFakeKubeVirt(t, "vm2")
	cfg := reservingConfig()
	cfg.ReservationTTL = time.Hour // only the release can free it
	q, _ := startQueue(t, f, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	f.reservedBy("pvc-a", Reservation{VM: "vm1", Holder: cfg.Identity, At: time.Now()})
	if err := q.Detach(ctx, "vm1", "pvc-a"); err != nil {
		t.Fatalf("detach: %v", err)
	}
	if r := f.reservation("pvc-a"); !r.IsZero() {
		t.Fatalf("detach answered while its reservation %+v was still on the claim", r)
	}
	if err := q.Attach(ctx, "vm2", "pvc-a", true); err != nil {
		t.Fatalf("attach to vm2 after the release: %v", err)
	}
}

// A reservation of this process that is no longer fresh is renewed before
// the attach is written under it: another controller's takeover is timed
// from the reservation's time, so an old one must not cover a new write.
func TestAgingReservationIsRenewedBeforeTheWrite(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	cfg := reservingConfig()
	q, _ := startQueue(t, f, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	old := Reservation{VM: "vm1", Holder: cfg.Identity, At: time.Now().Add(-cfg.ReservationFresh)}
	f.reservedBy("pvc-a", old)
	before := time.Now()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatalf("attach: %v", err)
	}
	if r := f.reservation("pvc-a"); r.VM != "vm1" || r.Holder != cfg.Identity || r.At.Before(before) {
		t.Fatalf("reservation after the attach %+v, want one renewed after %v", r, before)
	}
}

// fakeClaimCache is a claim cache over the fake host: current, except for
// the claims in stale, which it shows as given.
type fakeClaimCache struct {
	f     *fakeKubeVirt
	stale map[string]HostClaim
}

func (c *fakeClaimCache) CachedClaim(claim string) (HostClaim, bool) {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	cl, ok := c.stale[claim]
	if !ok {
		cl = c.f.claimLocked(claim)
	}
	cl.Cached = true
	return cl, cl.Exists
}

// since is what the fake host was asked between two counts.
func (h hostRequests) since(before hostRequests) hostRequests {
	return hostRequests{claimReads: h.claimReads - before.claimReads, claimWrites: h.claimWrites - before.claimWrites,
		vmLists: h.vmLists - before.vmLists, vmiLists: h.vmiLists - before.vmiLists}
}

// A move of a volume that stayed on its VM longer than its reservation
// lives costs one claim request: the reservation's write for the new VM,
// made from the claim cache (its resourceVersion precondition is the claim
// check). The expired reservation is not released (it fences nobody), and
// it is taken over without reading the holders again (it expired before the
// live read was asked for).
func TestMoveAfterTheReservationExpiredWritesTheClaimOnce(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	cfg := reservingConfig()
	q, _ := startQueue(t, f, cfg)
	q.SetClaimCache(&fakeClaimCache{f: f})
	watchDoubleAttach(t, f, "pvc-a")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatalf("attach to vm1: %v", err)
	}
	// The volume stays on vm1 for longer than the reservation's TTL.
	f.reservedBy("pvc-a", Reservation{VM: "vm1", Holder: cfg.Identity, At: time.Now().Add(-2 * cfg.ReservationTTL)})
	before := f.requests()
	if err := q.Detach(ctx, "vm1", "pvc-a"); err != nil {
		t.Fatalf("detach from vm1: %v", err)
	}
	if err := q.Attach(ctx, "vm2", "pvc-a", true); err != nil {
		t.Fatalf("attach to vm2: %v", err)
	}
	want := hostRequests{claimReads: 0, claimWrites: 1, vmLists: 1, vmiLists: 1}
	if got := f.requests().since(before); got != want {
		t.Errorf("host requests of the move %+v, want %+v", got, want)
	}
	if r := f.reservation("pvc-a"); r.VM != "vm2" || r.Holder != cfg.Identity {
		t.Errorf("reservation after the move %+v, want vm2's by %s", r, cfg.Identity)
	}
}

// A detach observed within the reservation's TTL releases it with one
// write from the claim cache, no read.
func TestReleaseWithinTheTTLIsOneWrite(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1")
	cfg := reservingConfig()
	cfg.ReservationTTL = time.Hour
	q, _ := startQueue(t, f, cfg)
	q.SetClaimCache(&fakeClaimCache{f: f})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatalf("attach: %v", err)
	}
	before := f.requests()
	if err := q.Detach(ctx, "vm1", "pvc-a"); err != nil {
		t.Fatalf("detach: %v", err)
	}
	if got, want := f.requests().since(before), (hostRequests{claimWrites: 1}); got != want {
		t.Errorf("host requests of the detach %+v, want %+v", got, want)
	}
	if r := f.reservation("pvc-a"); !r.IsZero() {
		t.Errorf("detach answered with the reservation %+v still on the claim", r)
	}
}

// A reservation another VM's writer left long expired is taken over with
// one read of the holders: every write under it ended before that read was
// asked for.
func TestLongExpiredReservationIsTakenOverWithOneLiveRead(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	cfg := reservingConfig()
	q, _ := startQueue(t, f, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	f.reservedBy("pvc-a", Reservation{VM: "vm2", Holder: "controller-2", At: time.Now().Add(-10 * cfg.ReservationTTL)})
	before := f.requests()
	if err := q.Attach(ctx, "vm1", "pvc-a", true); err != nil {
		t.Fatalf("attach: %v", err)
	}
	if got := f.requests().since(before); got.vmLists != 1 || got.vmiLists != 1 {
		t.Errorf("VM and VMI lists %d and %d, want 1 each", got.vmLists, got.vmiLists)
	}
}

// The claim cache never decides on its own: a stale copy only seeds a
// write, whose precondition fails when the claim changed, and whatever it
// would not write is decided on a read.
func TestStaleClaimCacheIsNeverTheFence(t *testing.T) {
	f := newFakeKubeVirt(t, "vm1", "vm2")
	f.claims = map[string]corev1.PersistentVolumeClaimPhase{"pvc-gone": ""}
	cfg := reservingConfig()
	q, _ := startQueue(t, f, cfg)
	bound := func(name string, version int, r Reservation) HostClaim {
		return (&fakePVC{version: version, reserved: r}).claim(name, corev1.ClaimBound)
	}
	cc := &fakeClaimCache{f: f, stale: map[string]HostClaim{
		// deleted on the host, still Bound in the cache
		"pvc-gone": bound("pvc-gone", 1, Reservation{}),
		// another VM reserved it since the cache's copy
		"pvc-taken": bound("pvc-taken", 1, Reservation{}),
		// the cache still shows another VM's reservation, since released
		"pvc-freed": bound("pvc-freed", 1, Reservation{VM: "vm2", Holder: "controller-2", At: time.Now()}),
	}}
	q.SetClaimCache(cc)
	f.reservedBy("pvc-taken", Reservation{VM: "vm2", Holder: "controller-2", At: time.Now()})
	f.reservedBy("pvc-freed", Reservation{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	var notReady *ClaimNotReadyError
	if err := q.Attach(ctx, "vm1", "pvc-gone", true); !errors.As(err, &notReady) {
		t.Errorf("attach of a claim deleted behind the cache answered %v, want ClaimNotReadyError", err)
	}
	var held *HeldError
	if err := q.Attach(ctx, "vm1", "pvc-taken", true); !errors.As(err, &held) || held.VM != "vm2" {
		t.Errorf("attach of a claim reserved behind the cache answered %v, want a HeldError naming vm2", err)
	}
	if err := q.Attach(ctx, "vm1", "pvc-freed", true); err != nil {
		t.Errorf("attach of a claim released behind the cache: %v", err)
	}
	for _, vol := range []string{"pvc-gone", "pvc-taken"} {
		if h := f.specHolders(vol); len(h) > 0 {
			t.Errorf("%s written to %v", vol, h)
		}
	}
}
