package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/csiattacher"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// scene creates a scenario's VMs and its n volumes (named after prefix), and
// dumps their state if the scenario fails.
func (s *suite) scene(t *testing.T, prefix string, n int, vms ...string) []string {
	t.Helper()
	s.host.CreateVMs(t, vms...)
	s.dumpOnFailure(t, vms...)
	return s.host.CreateVolumes(t, prefix, n)
}

// publishedOn is the start of a move: one volume on fresh VMs vms, published
// to the first of them.
func (s *suite) publishedOn(ctx context.Context, t *testing.T, prefix string, vms ...string) (string, *attacher) {
	t.Helper()
	vol := s.scene(t, prefix, 1, vms...)[0]
	a := newAttacher(s.client)
	if err := a.publish(ctx, vms[0], vol); err != nil {
		t.Fatal(err)
	}
	return vol, a
}

// eachAtOnce calls f for every volume, each on its own goroutine, as the
// external-attacher's workers send one call per VolumeAttachment together,
// and returns when every call has.
func eachAtOnce(vols []string, f func(i int, vol string)) {
	var wg sync.WaitGroup
	for i, vol := range vols {
		wg.Go(func() { f(i, vol) })
	}
	wg.Wait()
}

// unpublishAll takes every volume off vm, each failure an error of t.
func unpublishAll(ctx context.Context, t *testing.T, a *attacher, vm string, vols []string) {
	t.Helper()
	for _, vol := range vols {
		if err := a.unpublish(ctx, vm, vol); err != nil {
			t.Errorf("unpublish %s from %s: %v", vol, vm, err)
		}
	}
}

// concurrentPublishes: 20 publishes to one VM at once all succeed, and the
// declarative backend needs at most 3 VM spec writes for them.
func (s *suite) concurrentPublishes(t *testing.T) {
	vm := "cp-vm"
	vols := s.scene(t, "cp", 20, vm)
	s.resetStats()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	errs := make([]error, len(vols))
	eachAtOnce(vols, func(i int, vol string) { errs[i] = a.publish(ctx, vm, vol) })
	for i, err := range errs {
		if err != nil {
			t.Errorf("publish %s: %v", vols[i], err)
		} else {
			s.requireReady(vm, vols[i])
		}
	}
	if st, ok := s.stats(); ok {
		t.Logf("%s: VM spec writes %d, status writes %d, addvolume %d, conflicts %d/%d, answers %v",
			s.f.name, st.VMSpecWrites, st.VMStatusWrites, st.AddVolume, st.Conflicts, st.Unprocessable, a.Answers())
		if s.f.backend == kubevirt.BackendDeclarative && st.VMSpecWrites > 3 {
			t.Errorf("20 publishes took %d VM spec writes, want at most 3", st.VMSpecWrites)
		}
		if s.f.backend == kubevirt.BackendSubresource && !s.f.forced && st.VMSpecWrites != 0 {
			t.Errorf("subresource backend wrote the VM spec %d times, want 0", st.VMSpecWrites)
		}
		// With the legacy gate on, batches go into the request list: no
		// virt-api call, and far fewer writes than publishes.
		if s.f.backend == kubevirt.BackendSubresource && !s.f.forced && (st.AddVolume != 0 || st.VMStatusWrites > 10) {
			t.Errorf("legacy KubeVirt: 20 publishes took %d addvolume calls and %d status writes, want none and at most 10", st.AddVolume, st.VMStatusWrites)
		}
	}
	if l := a.leaked(); len(l) > 0 {
		t.Errorf("KubeVirt duplicate errors reached the caller: %q", l)
	}
	unpublishAll(ctx, t, a, vm, vols)
}

// storm: publishes and unpublishes on three VMs, volumes moving between
// them, converge with every call answered and nothing left attached.
func (s *suite) storm(t *testing.T) {
	vms := []string{"st-a", "st-b", "st-c"}
	vols := s.scene(t, "st", 12, vms...)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	eachAtOnce(vols, func(i int, vol string) {
		for round := range 3 {
			vm := vms[(i+round)%len(vms)] // each round the volume moves to the next VM
			if err := a.publish(ctx, vm, vol); err != nil {
				t.Errorf("round %d: publish %s to %s: %v", round, vol, vm, err)
				return
			}
			if got := s.attachedTo(vol, vms...); len(got) != 1 || got[0] != vm {
				t.Errorf("round %d: %s published to %s but held by %v", round, vol, vm, got)
			}
			if err := a.unpublish(ctx, vm, vol); err != nil {
				t.Errorf("round %d: unpublish %s from %s: %v", round, vol, vm, err)
				return
			}
			if got := s.attachedTo(vol, vms...); len(got) != 0 {
				t.Errorf("round %d: %s unpublished but still held by %v", round, vol, got)
			}
		}
	})
	t.Logf("%s: answers %v", s.f.name, a.Answers())
	if l := a.leaked(); len(l) > 0 {
		t.Errorf("KubeVirt duplicate errors reached the caller: %q", l)
	}
	if n := a.Answers()[codes.FailedPrecondition]; n > 0 {
		t.Errorf("%d FailedPrecondition answers for volumes that were never held elsewhere: %v", n, a.Errors())
	}
}

// cancelBeforeBatch: an unpublish that arrives while the publish still waits
// for its batch answers the publish Aborted and writes nothing.
func (s *suite) cancelBeforeBatch(t *testing.T) {
	vm := "cb-vm"
	vol := s.scene(t, "cb", 1, vm)[0]
	cfg := queueConfig()
	cfg.BatchWindow = 2 * time.Second
	s.ctrl.Stop()
	ctrl := s.host.StartController(s.t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: cfg})
	defer func() {
		ctrl.Stop()
		s.ctrl = s.host.StartController(s.t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig()})
	}()
	s.resetStats()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	published := make(chan error, 1)
	go func() {
		_, err := ctrl.Client.ControllerPublishVolume(ctx, publishReq(vm, vol))
		published <- err
	}()
	ctrl.WaitQueued(t, vm, 1)
	if _, err := ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: vm}); err != nil {
		t.Fatalf("unpublish: %v", err)
	}
	if err := <-published; status.Code(err) != codes.Aborted {
		t.Fatalf("publish answered %v, want Aborted (superseded)", err)
	}
	time.Sleep(cfg.BatchWindow + 200*time.Millisecond)
	// Without the simulator's counters, the VM's spec and request list
	// (anyWritten) show what a write would have left.
	if s.anyWritten(vm, []string{vol}) {
		t.Errorf("a cancelled publish wrote to KubeVirt")
	}
	if st, ok := s.stats(); ok && st.VMSpecWrites+st.VMStatusWrites+st.AddVolume+st.RemoveVolume != 0 {
		t.Errorf("a cancelled publish wrote to KubeVirt: %+v", st)
	}
	if got := s.attachedTo(vol, vm); len(got) != 0 {
		t.Errorf("volume held by %v after cancel", got)
	}
}

// exclusive: an RWO volume published to one VM is refused on another with
// FailedPrecondition naming the holder, and moves once unpublished.
func (s *suite) exclusive(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vol, a := s.publishedOn(ctx, t, "ex", "ex-a", "ex-b")
	s.move(ctx, t, a, vol, "ex-a", "ex-b")
	if err := a.unpublish(ctx, "ex-b", vol); err != nil {
		t.Fatal(err)
	}
}

// move checks that vol, held by from, is refused to to with
// FailedPrecondition naming from, then unpublishes it from from (answered OK
// only once from really let go) and publishes it to to.
func (s *suite) move(ctx context.Context, t *testing.T, a *attacher, vol, from, to string) {
	t.Helper()
	_, err := s.client().ControllerPublishVolume(ctx, publishReq(to, vol))
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), from) {
		t.Errorf("publish to %s while %s holds the volume answered %v, want FailedPrecondition naming %s", to, from, err, from)
	}
	if err := a.unpublish(ctx, from, vol); err != nil {
		t.Fatalf("unpublish from %s: %v", from, err)
	}
	if got := s.attachedTo(vol, from); len(got) != 0 {
		t.Fatalf("unpublish answered OK while %v holds the volume", got)
	}
	if err := a.publish(ctx, to, vol); err != nil {
		t.Fatalf("publish to %s after the move: %v", to, err)
	}
}

// webhookDenied: a volume the host's admission webhook refuses fails alone,
// the rest of its batch attaches.
func (s *suite) webhookDenied(t *testing.T) {
	vm := "wd-vm"
	s.simOnly(t, "webhook fault")
	vols := s.scene(t, "wd", 5, vm)
	bad := vols[2]
	s.host.Sim.Faults().DenyVolume(bad, "")
	defer s.host.Sim.Faults().AllowVolume(bad)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	errs := make([]error, len(vols))
	eachAtOnce(vols, func(i int, vol string) {
		// The bad volume's attacher would retry forever; bound it.
		cctx, c := context.WithTimeout(ctx, 20*time.Second)
		defer c()
		errs[i] = a.publish(cctx, vm, vol)
	})
	for i, err := range errs {
		switch {
		case vols[i] == bad && status.Code(err) != codes.FailedPrecondition:
			t.Errorf("denied volume answered %v, want FailedPrecondition", err)
		case vols[i] == bad && !strings.Contains(err.Error(), "refused by an admission policy"):
			t.Errorf("denied volume's answer %q lacks the webhook's reason", err)
		case vols[i] != bad && err != nil:
			t.Errorf("publish %s: %v", vols[i], err)
		}
	}
	// Whatever the refused attach left (a queued request, a VMI that took the
	// volume) is undone by the queue on its own.
	undone, cancelUndone := context.WithTimeout(ctx, 15*time.Second)
	defer cancelUndone()
	testwait.Until(undone, t, "the denied volume to leave the VM", func() (bool, string) {
		on := s.attachedTo(bad, vm)
		return len(on) == 0, fmt.Sprintf("held by %v", on)
	})
	for _, vol := range vols {
		if vol != bad {
			if err := a.unpublish(ctx, vm, vol); err != nil {
				t.Errorf("unpublish %s: %v", vol, err)
			}
		}
	}
}

// deletedVM: a VM deleted while holding a volume keeps it until its VMI is
// gone; then unpublish from it succeeds and the volume attaches elsewhere.
func (s *suite) deletedVM(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vol, a := s.publishedOn(ctx, t, "dv", "dv-a", "dv-b")
	if err := s.host.DeleteVM(ctx, "dv-a"); err != nil {
		t.Fatal(err)
	}
	// Right after the delete the VMI still runs with the volume.
	s.move(ctx, t, a, vol, "dv-a", "dv-b")
	if err := a.unpublish(ctx, "dv-b", vol); err != nil {
		t.Fatal(err)
	}
}

// stoppedVM: a guest node powered off keeps its hot-plugged volume in the VM
// spec, so the volume stays fenced to it; the attacher's unpublish (after
// kubelet gives up on the node) takes it out of the stopped VM, the volume
// attaches elsewhere, and starting the old VM again does not bring it back.
func (s *suite) stoppedVM(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vol, a := s.publishedOn(ctx, t, "sv", "sv-a", "sv-b")
	if err := s.host.StopVM(ctx, "sv-a"); err != nil {
		t.Fatal(err)
	}
	s.move(ctx, t, a, vol, "sv-a", "sv-b")
	if err := s.host.StartVM(ctx, "sv-a"); err != nil {
		t.Fatal(err)
	}
	if got := s.attachedTo(vol, "sv-a"); len(got) != 0 {
		t.Errorf("the restarted VM took the volume back: %v", got)
	}
	if err := a.unpublish(ctx, "sv-b", vol); err != nil {
		t.Fatal(err)
	}
}

// timedOutPublishThenUnpublish: a publish whose deadline passes after its
// write reached KubeVirt, followed by an unpublish (the pod was deleted
// meanwhile). The unpublish answers OK only once the volume is really gone,
// and the attach that was still on its way does not land later (GCP PD's
// orphaned-disk race, reference peers.md).
func (s *suite) timedOutPublishThenUnpublish(t *testing.T) {
	s.simOnly(t, "stuck attachment-pod fault")
	vm := "to-vm"
	vol := s.scene(t, "to", 1, vm)[0]
	ns := s.host.Namespace
	s.host.Sim.Faults().SetAttachmentPodsStuck(ns, vm, true)
	released := false
	defer func() {
		if !released {
			s.host.Sim.Faults().SetAttachmentPodsStuck(ns, vm, false)
		}
	}()

	short, cancelShort := context.WithTimeout(context.Background(), 3*time.Second)
	_, err := s.client().ControllerPublishVolume(short, publishReq(vm, vol))
	cancelShort()
	if code := status.Code(err); code != codes.DeadlineExceeded {
		t.Fatalf("publish with a stuck attachment pod answered %v, want DeadlineExceeded", err)
	}
	if !s.anyWritten(vm, []string{vol}) {
		t.Fatal("the timed-out publish never reached KubeVirt; the scenario needs the attach in flight")
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	if err := a.unpublish(ctx, vm, vol); err != nil {
		t.Fatalf("unpublish: %v", err)
	}
	if got := s.attachedTo(vol, vm); len(got) != 0 {
		t.Fatalf("unpublish answered OK while %v still holds the volume", got)
	}
	// The attachment pod may start now: nothing may bring the volume back.
	s.host.Sim.Faults().SetAttachmentPodsStuck(ns, vm, false)
	released = true
	time.Sleep(scaled(20 * time.Second))
	if got := s.attachedTo(vol, vm); len(got) != 0 {
		t.Errorf("the abandoned attach landed after the unpublish: %v", got)
	}
}

// restartMidBatch: the controller dies right after its first write to a VM;
// a new one finishes every publish on retry, with no volume attached twice
// and no publish to a second VM let through meanwhile.
func (s *suite) restartMidBatch(t *testing.T) {
	vols := s.scene(t, "rs", 10, "rs-a", "rs-b")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s.resetStats()
	first := make(chan error, len(vols))
	for _, vol := range vols {
		go func() {
			_, err := s.client().ControllerPublishVolume(ctx, publishReq("rs-a", vol))
			first <- err
		}()
	}
	// Kill the controller as soon as its first write is visible on the VM.
	// Every 2 ms: the kill must come while the batch is still in flight.
	written, cancelWritten := context.WithTimeout(ctx, 20*time.Second)
	defer cancelWritten()
	testwait.UntilEvery(written, t, 2*time.Millisecond, "the controller's first write to rs-a", func() (bool, string) {
		return s.anyWritten("rs-a", vols), "nothing written"
	})
	s.ctrl.Stop()
	for range vols {
		// The cut-off calls must answer something retriable, never OK.
		if err := <-first; csiattacher.Final(err) {
			t.Errorf("a publish cut off by the restart answered %v", err)
		}
	}
	s.ctrl = s.host.StartController(s.t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig()})
	// What the dead controller wrote is visible to the new one at once: a
	// volume it wrote is fenced from rs-b; one it never wrote may go there,
	// but never to both VMs.
	var fenced int
	for _, vol := range vols {
		cctx, c := context.WithTimeout(ctx, 5*time.Second)
		_, err := s.client().ControllerPublishVolume(cctx, publishReq("rs-b", vol))
		c()
		switch status.Code(err) {
		case codes.FailedPrecondition:
			fenced++
			if !strings.Contains(err.Error(), "rs-a") {
				t.Errorf("%s fenced without naming rs-a: %v", vol, err)
			}
		case codes.OK:
			if got := s.attachedTo(vol, "rs-a", "rs-b"); len(got) != 1 || got[0] != "rs-b" {
				t.Errorf("%s published to rs-b but held by %v", vol, got)
			}
			if err := newAttacher(s.client).unpublish(ctx, "rs-b", vol); err != nil {
				t.Error(err)
			}
		default:
			t.Errorf("publish %s to rs-b answered %v", vol, err)
		}
	}
	if fenced == 0 {
		t.Error("no volume was fenced after the restart although the dead controller had written")
	}
	a := newAttacher(s.client)
	eachAtOnce(vols, func(_ int, vol string) {
		if err := a.publish(ctx, "rs-a", vol); err != nil {
			t.Errorf("retry publish %s: %v", vol, err)
		}
	})
	for _, vol := range vols {
		if got := s.attachedTo(vol, "rs-a", "rs-b"); len(got) != 1 || got[0] != "rs-a" {
			t.Errorf("%s held by %v after the retries, want [rs-a]", vol, got)
		}
		v, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Get(ctx, "rs-a", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, x := range v.Spec.Template.Spec.Volumes {
			if x.Name == vol {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%s appears %d times in the VM spec", vol, n)
		}
		if err := a.unpublish(ctx, "rs-a", vol); err != nil {
			t.Errorf("unpublish %s: %v", vol, err)
		}
	}
	if l := a.leaked(); len(l) > 0 {
		t.Errorf("KubeVirt duplicate errors reached the caller: %q", l)
	}
}
