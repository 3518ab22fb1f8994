package integration

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// The scenarios below aim at the states real KubeVirt never leaves (the
// simulator's contract tests pin them per version): they must end with every
// volume where the callers asked, on every version.

// entryOf describes the VMI's volume status entry for vol, for failures.
func (s *suite) entryOf(vm, vol string) string {
	vmi, err := s.kv.KubevirtV1().VirtualMachineInstances(s.host.Namespace).Get(context.Background(), vm, metav1.GetOptions{})
	if err != nil {
		return err.Error()
	}
	e, ok := kubevirtsim.FindVolumeStatus(vmi, vol)
	if !ok {
		return "no entry"
	}
	return fmt.Sprintf("%s/%s %q target=%q", e.Phase, e.Reason, e.Message, e.Target)
}

// cronJobReattach is the CronJob pattern: a volume detaches from a VM and
// the next run lands on the same VM at once, round after round. Re-adding
// while the VMI still holds the old entry sticks for good in KubeVirt before
// 1.8.2; the queue must wait for the entry to go, every time.
func (s *suite) cronJobReattach(t *testing.T) {
	vm := "cj-vm"
	vols := s.scene(t, "cj", 3, vm)
	a := newAttacher(s.client)
	eachAtOnce(vols, func(_ int, vol string) {
		for round := range 8 {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			err := a.publish(ctx, vm, vol)
			cancel()
			if err != nil {
				t.Errorf("round %d: publish %s: %v; entry %s", round, vol, err, s.entryOf(vm, vol))
				return
			}
			s.requireReady(vm, vol)
			ctx, cancel = context.WithTimeout(context.Background(), time.Minute)
			err = a.unpublish(ctx, vm, vol)
			cancel()
			if err != nil {
				t.Errorf("round %d: unpublish %s: %v; entry %s", round, vol, err, s.entryOf(vm, vol))
				return
			}
		}
	})
	if l := a.leaked(); len(l) > 0 {
		t.Errorf("KubeVirt duplicate errors reached the caller: %q", l)
	}
}

// claimDeletedWhileQueued: a publish waits in its batch window while its
// host claim is deleted. Writing it anyway would stall every new volume of
// the VM (KubeVirt aborts hotplug handling for the whole VMI on a missing
// claim); the other volume of the batch must attach, the deleted one be
// answered NotFound.
func (s *suite) claimDeletedWhileQueued(t *testing.T) {
	vm := "dc-vm"
	vols := s.scene(t, "dc", 2, vm)
	cfg := queueConfig()
	cfg.BatchWindow = 2 * time.Second
	ctrl := s.host.StartController(t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: cfg})
	defer ctrl.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res := make(map[string]chan error)
	for _, vol := range vols {
		res[vol] = make(chan error, 1)
		go func() {
			_, err := ctrl.Client.ControllerPublishVolume(ctx, publishReq(vm, vol))
			res[vol] <- err
		}()
	}
	ctrl.WaitQueued(t, vm, 2)
	if err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Delete(ctx, vols[0], metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := <-res[vols[0]]; status.Code(err) != codes.NotFound {
		t.Errorf("publish of the deleted claim answered %v, want NotFound", err)
	}
	if err := <-res[vols[1]]; err != nil {
		t.Errorf("the other volume of the batch: %v; entry %s", err, s.entryOf(vm, vols[1]))
	}
	s.requireReady(vm, vols[1])
	if e := s.entryOf(vm, vols[0]); e != "no entry" {
		t.Errorf("the deleted claim reached the VMI: %s", e)
	}
	if err := newAttacher(func() csiClient { return ctrl.Client }).unpublish(ctx, vm, vols[1]); err != nil {
		t.Error(err)
	}
}

// unboundClaim: a claim that never binds is not hot-plugged (KubeVirt would
// put it into the attachment pod, which then never starts, and no other new
// volume of the VM would attach); the VM's other volumes attach meanwhile.
func (s *suite) unboundClaim(t *testing.T) {
	vm := "ub-vm"
	vols := s.scene(t, "ub", 2, vm)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	class := "no-such-class"
	pending := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "ub-unbound", Namespace: s.host.Namespace},
		Spec: corev1.PersistentVolumeClaimSpec{StorageClassName: &class, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
	if _, err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Create(ctx, pending, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cctx, c := context.WithTimeout(ctx, 5*time.Second)
	_, err := s.client().ControllerPublishVolume(cctx, publishReq(vm, pending.Name))
	c()
	if status.Code(err) != codes.Aborted {
		t.Errorf("publish of an unbound claim answered %v, want Aborted (not Bound yet)", err)
	}
	a := newAttacher(s.client)
	for _, vol := range vols {
		if err := a.publish(ctx, vm, vol); err != nil {
			t.Errorf("publish %s beside an unbound claim: %v; entry %s", vol, err, s.entryOf(vm, vol))
		}
	}
	if e := s.entryOf(vm, pending.Name); e != "no entry" {
		t.Errorf("the unbound claim reached the VMI: %s", e)
	}
	unpublishAll(ctx, t, a, vm, vols)
}

// burstsAPodStartApart: waves of publishes to one VM, each about one
// attachment-pod start after the last, so every wave would change the
// hotplug set while the previous wave's pod is being replaced (the 16937
// livelock, and the reset of entries in flight). Every volume must end
// Ready.
func (s *suite) burstsAPodStartApart(t *testing.T) {
	vm := "bu-vm"
	vols := s.scene(t, "bu", 12, vm)
	a := newAttacher(s.client)
	var wg sync.WaitGroup
	for i, vol := range vols {
		if i%3 == 0 && i > 0 {
			time.Sleep(scaled(6 * time.Second))
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := a.publish(ctx, vm, vol); err != nil {
				t.Errorf("publish %s: %v; entry %s", vol, err, s.entryOf(vm, vol))
			}
		}()
	}
	wg.Wait()
	for _, vol := range vols {
		s.requireReady(vm, vol)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	unpublishAll(ctx, t, a, vm, vols)
}

// reattachWhileDetaching: the unpublish's caller gives up before KubeVirt
// has dropped the volume, and the next publish to the same VM comes at once,
// while the VMI still holds the old entry. Writing the add then would leave
// the entry stuck for good before KubeVirt 1.8.2; the publish must wait for
// the entry to go and then succeed, round after round. --max-hold is tiny
// here, so that waiting for KubeVirt to settle cannot hide the rule.
func (s *suite) reattachWhileDetaching(t *testing.T) {
	vm := "rd-vm"
	vols := s.scene(t, "rd", 2, vm)
	cfg := queueConfig()
	cfg.MaxHold = 20 * time.Millisecond
	ctrl := s.host.StartController(t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: cfg})
	defer ctrl.Stop()
	client := func() csiClient { return ctrl.Client }
	a := newAttacher(client)
	ctx, cancel := context.WithTimeout(context.Background(), s.budget(3*time.Minute))
	defer cancel()
	// A round counts only when a publish went out while the VMI still
	// held the entry whose removal was written: a removal that finished
	// within the short deadline tests nothing, so rounds go on until four
	// publishes raced a removal.
	const want = 4
	raced := 0
	for round := 0; ; round++ {
		for _, vol := range vols {
			if s.removalInFlight(vm, vol) {
				raced++
			}
			if err := a.publish(ctx, vm, vol); err != nil {
				t.Fatalf("round %d: publish %s: %v; entry %s", round, vol, err, s.entryOf(vm, vol))
			}
			s.requireReady(vm, vol)
		}
		if raced >= want {
			t.Logf("%d rounds, %d publishes raced a removal", round+1, raced)
			break
		}
		if round == 50 {
			t.Fatalf("only %d of %d publishes came while a removal was in flight after %d rounds", raced, want, round)
		}
		for _, vol := range vols {
			// Long enough for the removal to be written, too short for it
			// to finish.
			cctx, c := context.WithTimeout(ctx, scaled(4*time.Second))
			_, err := client().ControllerUnpublishVolume(cctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: vm})
			c()
			if err == nil {
				t.Logf("round %d: unpublish of %s finished within its short deadline", round, vol)
			}
		}
	}
	for _, vol := range vols {
		if err := a.unpublish(ctx, vm, vol); err != nil {
			t.Fatal(err)
		}
	}
}

// removalInFlight reports, from a live read, that the VM no longer asks for
// vol (its removal is written) while the VMI still has vol's entry.
func (s *suite) removalInFlight(vm, vol string) bool {
	vmi, err := s.kv.KubevirtV1().VirtualMachineInstances(s.host.Namespace).Get(context.Background(), vm, metav1.GetOptions{})
	if err != nil {
		return false
	}
	if _, ok := kubevirtsim.FindVolumeStatus(vmi, vol); !ok {
		return false
	}
	v, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Get(context.Background(), vm, metav1.GetOptions{})
	return err == nil && !kubevirtsim.HasVolume(v.Spec.Template.Spec.Volumes, vol) && !s.anyWritten(vm, []string{vol})
}
