package integration

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// holderMonitor reads the API server every few milliseconds, as
// fencingUnderLag's monitor does, and keeps every moment a volume was in two
// VMs (spec, legacy request list, VMI spec or VMI volume status) at once.
type holderMonitor struct {
	stop chan struct{}
	done chan struct{}
	mu   sync.Mutex
	seen []string
}

func (s *suite) monitorHolders(ctx context.Context, vols []string) *holderMonitor {
	m := &holderMonitor{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(m.done)
		for {
			select {
			case <-m.stop:
				return
			default:
			}
			for vol, holders := range s.liveHolders(ctx, vols) {
				if len(holders) > 1 {
					m.mu.Lock()
					if len(m.seen) < 20 {
						m.seen = append(m.seen, fmt.Sprintf("%s held by %v at once", vol, holders))
					}
					m.mu.Unlock()
				}
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	return m
}

// violations stops the monitor and returns what it saw.
func (m *holderMonitor) violations() []string {
	close(m.stop)
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.seen
}

// twoControllers runs two controller processes against one host namespace
// (each with its own clients, informers and queue, as two pods of an HA
// install whose leader handover overlaps, or a rolling update, would be).
// Round after round both get a publish of the same RWO volume at the same
// moment, each for a different VM: exactly one may succeed, the other must be
// refused with FailedPrecondition, and the monitor must never see the volume
// in both VMs. Unpublishing the winner must then let the other VM have it.
func (s *suite) twoControllers(t *testing.T) {
	vms := []string{"tc-a", "tc-b"}
	vol := s.scene(t, "tc", 1, vms...)[0]
	var ctrls []*framework.Controller
	for _, id := range []string{"controller-a", "controller-b"} {
		qc := queueConfig()
		qc.Identity = id // two pods: two names
		ctrls = append(ctrls, s.host.StartController(t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: qc}))
	}
	attachers := []*attacher{}
	for _, c := range ctrls {
		attachers = append(attachers, newAttacher(func() csiClient { return c.Client }))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	mon := s.monitorHolders(ctx, []string{vol})

	const rounds = 8
	var doubles int
	// settled waits until a controller's informers show nobody holding the
	// volume: each learns of the other's unpublish only from its watch.
	settled := func(c *framework.Controller) {
		t.Helper()
		testwait.For(t, "the controller's informers to show the volume free", 30*time.Second, func() bool {
			return len(c.Queue.Holders(vol)) == 0
		})
	}
	for round := range rounds {
		// Alternate which controller asks for which VM.
		vmOf := func(i int) string { return vms[(i+round)%2] }
		for _, c := range ctrls {
			settled(c)
		}
		start := make(chan struct{})
		errs := make([]error, len(ctrls))
		var wg sync.WaitGroup
		for i := range ctrls {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				errs[i] = attachers[i].publish(ctx, vmOf(i), vol)
			}()
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, err := range errs {
			switch status.Code(err) {
			case codes.OK:
				if winner >= 0 {
					doubles++
					t.Errorf("round %d: both publishes answered OK (%s and %s)", round, vmOf(winner), vmOf(i))
				}
				winner = i
			case codes.FailedPrecondition:
			default:
				t.Fatalf("round %d: publish to %s answered %v, want OK or FailedPrecondition", round, vmOf(i), err)
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: both publishes refused: %v", round, errs)
		}
		if doubles > 0 {
			// Clean up both before the next round.
			for i := range ctrls {
				if err := attachers[i].unpublish(ctx, vmOf(i), vol); err != nil {
					t.Fatalf("round %d: unpublish from %s: %v", round, vmOf(i), err)
				}
			}
			continue
		}
		loser := 1 - winner
		if err := attachers[winner].unpublish(ctx, vmOf(winner), vol); err != nil {
			t.Fatalf("round %d: unpublish from %s: %v", round, vmOf(winner), err)
		}
		// The other controller may now have it for its VM at once: the
		// winner's reservation went with the detach (left behind, it
		// would refuse this publish for 30 s).
		settled(ctrls[loser])
		if err := attachers[loser].publish(ctx, vmOf(loser), vol); err != nil {
			t.Fatalf("round %d: publish to %s after %s let go: %v", round, vmOf(loser), vmOf(winner), err)
		}
		if err := attachers[loser].unpublish(ctx, vmOf(loser), vol); err != nil {
			t.Fatalf("round %d: unpublish from %s: %v", round, vmOf(loser), err)
		}
	}
	for _, v := range mon.violations() {
		t.Error(v)
	}
	if doubles > 0 {
		t.Errorf("%d of %d rounds attached the volume to both VMs", doubles, rounds)
	}
}

// reservationCAS: the reservation on a host PVC is a compare-and-swap on a
// real API server. Processes that reserve from the same read race, and
// exactly one wins; a write from a read that is no longer current is
// refused; and the PVC's other annotations survive.
func (s *suite) reservationCAS(t *testing.T) {
	vol := s.host.CreateVolumes(t, "rc", 1)[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pvcs := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pvc, err := pvcs.Get(ctx, vol, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pvc.Annotations == nil {
			pvc.Annotations = map[string]string{}
		}
		pvc.Annotations["example.com/keep"] = "yes"
		_, err = pvcs.Update(ctx, pvc, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	const writers = 5
	clients := make([]*host.Client, writers)
	reads := make([]hotplug.HostClaim, writers)
	for i := range clients {
		if clients[i], err = host.NewForConfig(s.host.ClientConfig(), s.host.Namespace); err != nil {
			t.Fatal(err)
		}
		if reads[i], err = clients[i].Claim(ctx, vol); err != nil {
			t.Fatal(err)
		}
	}
	at := time.Now()
	errs := make([]error, writers)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = clients[i].Reserve(ctx, reads[i], hotplug.Reservation{VM: fmt.Sprintf("vm-%d", i), Holder: fmt.Sprintf("controller-%d", i), At: at})
		}()
	}
	wg.Wait()
	winner := -1
	for i, err := range errs {
		switch {
		case err == nil && winner < 0:
			winner = i
		case err == nil:
			t.Fatalf("writers %d and %d both reserved the volume from the same read", winner, i)
		case !apierrors.IsConflict(err):
			t.Fatalf("writer %d: %v, want a conflict", i, err)
		}
	}
	if winner < 0 {
		t.Fatalf("no writer reserved the volume: %v", errs)
	}
	now, err := clients[0].Claim(ctx, vol)
	if err != nil {
		t.Fatal(err)
	}
	want := hotplug.Reservation{VM: fmt.Sprintf("vm-%d", winner), Holder: fmt.Sprintf("controller-%d", winner), At: at}
	if r := now.Reserved; r.VM != want.VM || r.Holder != want.Holder || !r.At.Equal(want.At) {
		t.Fatalf("reservation read back %+v, want %+v", r, want)
	}
	if now.Object.Annotations["example.com/keep"] != "yes" {
		t.Fatalf("another annotation was lost: %v", now.Object.Annotations)
	}
	// Releasing from the stale read is refused; from the current one it
	// works and leaves the rest alone.
	if _, err := clients[winner].Reserve(ctx, reads[winner], hotplug.Reservation{}); !apierrors.IsConflict(err) {
		t.Fatalf("release from a stale read answered %v, want a conflict", err)
	}
	released, err := clients[winner].Reserve(ctx, now, hotplug.Reservation{})
	if err != nil {
		t.Fatal(err)
	}
	if !released.Reserved.IsZero() || released.Object.Annotations["example.com/keep"] != "yes" {
		t.Fatalf("after the release: reservation %+v, annotations %v", released.Reserved, released.Object.Annotations)
	}
}
