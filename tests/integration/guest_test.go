package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// guestSuite is a host flavor and a guest API server with the controller
// reading the guest's Nodes and CSINodes.
type guestSuite struct {
	*suite
	guest *framework.Guest
}

// TestGuestAware runs the detach guard and ControllerGetVolume against a
// host on legacy KubeVirt 1.7 (the subresource backend: a refused attach
// there leaves a queued request the queue itself must withdraw) and a guest
// API server whose Nodes the test writes as kubelet would.
func TestGuestAware(t *testing.T) {
	f := flavor{"legacy-v1.7", kubevirtsim.ModeLegacy, kubevirtsim.V1_7_0, kvbackend.BackendSubresource, false}
	h := framework.StartHost(t, kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: scale, BindClasslessPVCs: true})
	s := &guestSuite{suite: &suite{t: t, f: f, host: h, kv: kubevirt.NewForConfigOrDie(h.Env.Config)}, guest: framework.StartGuest(t)}
	s.ctrl = h.StartController(t, framework.ControllerOptions{Backend: f.backendFlag(), Queue: queueConfig(),
		Guest: s.guest.Env.Config, DetachGuardTimeout: time.Hour})
	t.Run("DetachGuardWaitsForTheGuest", s.detachGuard)
	t.Run("DetachGuardDoesNotBlock", s.guardDoesNotBlock)
	t.Run("DetachGuardHoldsWhileTheNodePluginRestarts", s.guardWithoutRegistration)
	t.Run("QueueCleanupIsNotGuarded", s.cleanupNotGuarded)
	t.Run("ControllerGetVolume", s.getVolume)
	t.Run("DetachGuardTimeoutSurvivesRestarts", s.timeoutAcrossRestarts) // restarts the controller
	t.Run("DetachGuardForcesAfterItsTimeout", s.forced)                  // last: restarts the controller
}

// waitGuestCache returns once the controller's guest cache shows the Node
// named so in the state cond wants (nil: the Node is gone), so that a test
// asks the guard only about what it can already see.
func (s *guestSuite) waitGuestCache(t *testing.T, name string, cond func(*corev1.Node) bool) {
	t.Helper()
	nodes := s.ctrl.Driver.GuestNodes()
	testwait.For(t, "the controller's guest cache to show the expected state of node "+name, 30*time.Second, func() bool {
		n, ok := nodes.Node(name)
		if !ok {
			n = nil
		}
		return cond(n)
	})
}

// mountedOn gives a volume on fresh VM vm published to it, and guest node
// node on vm listing it in use as kubelet does for a mounted volume, once the
// controller's guest cache shows that: what the detach guard guards.
func (s *guestSuite) mountedOn(ctx context.Context, t *testing.T, prefix, vm, node string) (string, *attacher) {
	t.Helper()
	vol := s.scene(t, prefix, 1, vm)[0]
	s.guest.AddNode(t, node, vm)
	a := newAttacher(s.client)
	if err := a.publish(ctx, vm, vol); err != nil {
		t.Fatal(err)
	}
	s.guest.SetMounted(t, node, vol)
	s.waitGuestCache(t, node, listsInUse(vol))
	return vol, a
}

func listsInUse(vols ...string) func(*corev1.Node) bool {
	return func(n *corev1.Node) bool {
		if n == nil || len(n.Status.VolumesInUse) != len(vols) {
			return false
		}
		for _, v := range vols {
			if !slices.Contains(n.Status.VolumesInUse, guest.UniqueVolumeName(driver.Name, v)) {
				return false
			}
		}
		return true
	}
}

func (s *guestSuite) unpublishOnce(ctx context.Context, vm, vol string) error {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := s.ctrl.Client.ControllerUnpublishVolume(cctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: vm})
	return err
}

// detachGuard: the attach/detach controller asks for a detach
// while the guest still has the volume mounted (listed in volumesInUse and
// volumesAttached). The unplug is refused with Aborted, the volume stays
// Ready on the VM, and it leaves as soon as kubelet has unmounted it, even
// with a new pod on the node already waiting for it. A volume the guest
// does not list leaves at once.
func (s *guestSuite) detachGuard(t *testing.T) {
	vm, node := "dg-vm", "rke2-dg-worker" // the guest Node is not named after its VM
	vols := s.scene(t, "dg", 2, vm)
	s.guest.AddNode(t, node, vm)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	for _, vol := range vols {
		if err := a.publish(ctx, vm, vol); err != nil {
			t.Fatal(err)
		}
	}
	inUse, free := vols[0], vols[1]
	s.guest.SetMounted(t, node, inUse)
	s.waitGuestCache(t, node, listsInUse(inUse))

	if err := s.unpublishOnce(ctx, vm, free); err != nil {
		t.Fatalf("unpublish of a volume the guest does not list: %v", err)
	}
	if got := s.attachedTo(free, vm); len(got) != 0 {
		t.Errorf("%s still on %v after its unpublish", free, got)
	}
	for range 2 {
		err := s.unpublishOnce(ctx, vm, inUse)
		if status.Code(err) != codes.Aborted {
			t.Fatalf("unpublish while the guest lists the volume = %v, want Aborted", err)
		}
		for _, want := range []string{inUse, vm, node, "still in use"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("message %q lacks %q", err, want)
			}
		}
	}
	s.requireReady(vm, inUse)

	// Kubelet unmounts it, and a new pod on the same node already wants it:
	// still listed in use, but the attach/detach controller has taken it out
	// of volumesAttached before detaching, so kubelet cannot mount it until
	// the volume is attached again. Holding it would stall that pod.
	s.guest.SetAwaiting(t, node, inUse)
	s.waitGuestCache(t, node, func(n *corev1.Node) bool { return listsInUse(inUse)(n) && len(n.Status.VolumesAttached) == 0 })
	if err := a.unpublish(ctx, vm, inUse); err != nil {
		t.Fatalf("unpublish once kubelet unmounted (a new pod awaits the volume): %v", err)
	}
	if got := s.attachedTo(inUse, vm); len(got) != 0 {
		t.Errorf("%s still on %v after its unpublish", inUse, got)
	}
	if ev := s.guest.NodeEvents(t, node); len(ev) != 0 {
		t.Errorf("events on the node although nothing was forced: %+v", ev)
	}
}

// guardDoesNotBlock: a VM without guest Node, a guest Node tainted out of
// service (its kubelet is declared dead) and a guest Node that was deleted
// never hold a volume back.
func (s *guestSuite) guardDoesNotBlock(t *testing.T) {
	vms := []string{"nb-lonely", "nb-fenced", "nb-deleted"}
	vols := s.scene(t, "nb", 3, vms...)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	for i, vm := range vms {
		if err := a.publish(ctx, vm, vols[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.unpublish(ctx, vms[0], vols[0]); err != nil {
		t.Errorf("VM without guest node: %v", err)
	}

	fenced := "rke2-nb-fenced"
	s.guest.AddNode(t, fenced, vms[1])
	s.guest.SetMounted(t, fenced, vols[1])
	n, err := s.guest.Kube.CoreV1().Nodes().Get(ctx, fenced, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute})
	if _, err := s.guest.Kube.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.waitGuestCache(t, fenced, func(n *corev1.Node) bool { return n != nil && guest.OutOfService(n) && listsInUse(vols[1])(n) })
	if err := s.unpublishOnce(ctx, vms[1], vols[1]); err != nil {
		t.Errorf("node tainted out of service: %v", err)
	}

	deleted := "rke2-nb-deleted"
	s.guest.AddNode(t, deleted, vms[2])
	s.guest.SetMounted(t, deleted, vols[2])
	s.waitGuestCache(t, deleted, listsInUse(vols[2]))
	if err := s.unpublishOnce(ctx, vms[2], vols[2]); status.Code(err) != codes.Aborted {
		t.Fatalf("before the node is deleted: %v, want Aborted", err)
	}
	if err := s.guest.Kube.CoreV1().Nodes().Delete(ctx, deleted, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s.waitGuestCache(t, deleted, func(n *corev1.Node) bool { return n == nil })
	if err := s.unpublishOnce(ctx, vms[2], vols[2]); err != nil {
		t.Errorf("guest node deleted: %v", err)
	}
	for i, vm := range vms {
		if got := s.attachedTo(vols[i], vm); len(got) != 0 {
			t.Errorf("%s still on %v", vols[i], got)
		}
	}
}

// cleanupNotGuarded: kubelet lists a volume in use as soon as its pod is
// scheduled, before any attach. When the host refuses that attach, the
// queue withdraws what it wrote on its own; the guard, which only answers
// ControllerUnpublish, must not keep that request on the VM (it would stall
// every later volume of the VM). An unpublish of a volume the VM does not
// hold is not refused either.
func (s *guestSuite) cleanupNotGuarded(t *testing.T) {
	vm, node := "cu-vm", "rke2-cu-worker"
	bad := s.scene(t, "cu", 1, vm)[0]
	s.guest.AddNode(t, node, vm)
	s.guest.SetMounted(t, node, bad)
	s.waitGuestCache(t, node, listsInUse(bad))
	s.host.Sim.Faults().DenyVolume(bad, "")
	defer s.host.Sim.Faults().AllowVolume(bad)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	if err := a.publish(ctx, vm, bad); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("publish of a denied volume = %v, want FailedPrecondition", err)
	}
	undone, cancelUndone := context.WithTimeout(ctx, 30*time.Second)
	defer cancelUndone()
	testwait.Until(undone, t, "the refused attach to leave the VM", func() (bool, string) {
		on := s.attachedTo(bad, vm)
		return len(on) == 0 && !s.anyWritten(vm, []string{bad}), fmt.Sprintf("on %v", on)
	})
	if err := s.unpublishOnce(ctx, vm, bad); err != nil {
		t.Errorf("unpublish of a volume the VM does not hold, while the guest lists it: %v", err)
	}
}

// getVolume: published VMs and the volume's condition, healthy while all is
// well, abnormal when the VMI loses a hotplug its VM spec keeps (harvester
// 10588) or the host PVC is deleted under an attached volume; NotFound for a
// volume without host PVC.
func (s *guestSuite) getVolume(t *testing.T) {
	vm := "gv-vm"
	vols := s.scene(t, "gv", 3, vm)
	lost, deleted, idle := vols[0], vols[1], vols[2]
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	for _, vol := range []string{lost, deleted} {
		if err := a.publish(ctx, vm, vol); err != nil {
			t.Fatal(err)
		}
	}
	get := func(vol string) (*csi.ControllerGetVolumeResponse, error) {
		return s.ctrl.Client.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: vol})
	}
	for vol, want := range map[string][]string{lost: {vm}, deleted: {vm}, idle: nil} {
		resp, err := get(vol)
		if err != nil {
			t.Fatalf("get %s: %v", vol, err)
		}
		if st := resp.GetStatus(); !slices.Equal(st.GetPublishedNodeIds(), want) || st.GetVolumeCondition().GetAbnormal() {
			t.Errorf("%s: published %v, condition %+v; want %v and healthy", vol, st.GetPublishedNodeIds(), st.GetVolumeCondition(), want)
		}
	}
	if _, err := get("pvc-never-created"); status.Code(err) != codes.NotFound {
		t.Errorf("volume without host PVC: %v, want NotFound", err)
	}

	// Someone removes the volume from the VMI only: the VM spec keeps it.
	viaAPI := kubevirt.NewForConfigOrDie(s.host.Sim.ClientConfig())
	if err := viaAPI.KubevirtV1().VirtualMachineInstances(s.host.Namespace).RemoveVolume(ctx, vm, &kubevirtv1.RemoveVolumeOptions{Name: lost}); err != nil {
		t.Fatal(err)
	}
	if err := s.host.Sim.Wait(ctx, s.host.Namespace, vm, func(v *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		_, inVMI := kubevirtsim.FindVolumeStatus(vmi, lost)
		return !inVMI && vmi != nil && !kubevirtsim.HasVolume(vmi.Spec.Volumes, lost) && v != nil && kubevirtsim.HasVolume(v.Spec.Template.Spec.Volumes, lost)
	}); err != nil {
		t.Fatalf("VMI did not drop %s: %v", lost, err)
	}
	s.waitCondition(t, get, lost, []string{vm, "lost the hotplug"})
	if resp, _ := get(lost); len(resp.GetStatus().GetPublishedNodeIds()) != 0 {
		t.Errorf("a lost volume is reported published to %v", resp.GetStatus().GetPublishedNodeIds())
	}

	// The host PVC of an attached volume is deleted.
	if err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Delete(ctx, deleted, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s.waitCondition(t, get, deleted, []string{deleted})

	list, err := s.ctrl.Client.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range list.GetEntries() {
		if e.GetStatus().GetVolumeCondition() == nil {
			t.Errorf("ListVolumes entry %s without condition", e.GetVolume().GetVolumeId())
		}
		if id := e.GetVolume().GetVolumeId(); id == lost && !e.GetStatus().GetVolumeCondition().GetAbnormal() {
			t.Errorf("ListVolumes says %s is healthy", id)
		}
	}
	for _, vol := range []string{lost, deleted} {
		if err := a.unpublish(ctx, vm, vol); err != nil {
			t.Errorf("unpublish %s: %v", vol, err)
		}
	}
}

// waitCondition polls ControllerGetVolume until the volume is abnormal with
// every word of want in the message: the controller's informers follow the
// host asynchronously.
func (s *guestSuite) waitCondition(t *testing.T, get func(string) (*csi.ControllerGetVolumeResponse, error), vol string, want []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	testwait.Until(ctx, t, fmt.Sprintf("%s's condition to be abnormal naming %v", vol, want), func() (bool, string) {
		resp, err := get(vol)
		if err != nil {
			return false, err.Error()
		}
		cond := resp.GetStatus().GetVolumeCondition()
		return cond.GetAbnormal() && !slices.ContainsFunc(want, func(w string) bool { return !strings.Contains(cond.GetMessage(), w) }), cond.GetMessage()
	})
}

// forced: with a short --detach-guard-timeout, an unplug the guest keeps
// refusing goes ahead once the timeout, counted from the first refusal, has
// passed, and the guest Node gets a Warning Event saying so.
// guardWithoutRegistration: kubelet drops the driver from the CSINode while
// the node plugin restarts, which is when an unmount may never finish. The
// guest Node still lists the volume in use and attached, so the unplug stays
// refused until kubelet lets go, also for a controller started since.
func (s *guestSuite) guardWithoutRegistration(t *testing.T) {
	vm, node := "nr-vm", "rke2-nr-worker" // the CSINode alone maps them
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vol, a := s.mountedOn(ctx, t, "nr", vm, node)
	if err := s.unpublishOnce(ctx, vm, vol); status.Code(err) != codes.Aborted {
		t.Fatalf("unpublish while registered and in use = %v, want Aborted", err)
	}
	// The node plugin restarts: kubelet unregisters the driver. The
	// controller restarts too, so it never saw the mapping.
	cn, err := s.guest.Kube.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cn.Spec.Drivers = nil
	if _, err := s.guest.Kube.StorageV1().CSINodes().Update(ctx, cn, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Started for the suite's test, not this subtest's: later subtests use it.
	s.ctrl.Stop()
	s.ctrl = s.host.StartController(s.t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig(),
		Guest: s.guest.Env.Config, DetachGuardTimeout: time.Hour})
	testwait.For(t, "the restarted controller's guest caches", 30*time.Second, s.ctrl.Driver.GuestNodes().HasSynced)
	for range 2 {
		err := s.unpublishOnce(ctx, vm, vol)
		if status.Code(err) != codes.Aborted || !strings.Contains(err.Error(), node) {
			t.Fatalf("unpublish while the node plugin is unregistered and the guest lists the volume = %v, want Aborted naming %s", err, node)
		}
	}
	s.requireReady(vm, vol)
	s.guest.SetMounted(t, node)
	s.waitGuestCache(t, node, listsInUse())
	if err := a.unpublish(ctx, vm, vol); err != nil {
		t.Fatalf("unpublish once kubelet unmounted: %v", err)
	}
	if got := s.attachedTo(vol, vm); len(got) != 0 {
		t.Errorf("%s still on %v after its unpublish", vol, got)
	}
}

// timeoutAcrossRestarts: the guard's timeout counts from the deletion of
// the VolumeAttachment, which the guest API server keeps, so a controller
// started after that deletion plus the timeout lets the unplug through on
// its first call, with the Warning on the Node.
func (s *guestSuite) timeoutAcrossRestarts(t *testing.T) {
	const timeout = 3 * time.Second
	restart := func() {
		s.ctrl.Stop()
		s.ctrl = s.host.StartController(s.t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig(),
			Guest: s.guest.Env.Config, DetachGuardTimeout: timeout})
		testwait.For(t, "the restarted controller's guest caches", 30*time.Second, s.ctrl.Driver.GuestNodes().HasSynced)
	}
	restart()
	vm, node := "tr-vm", "rke2-tr-worker"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vol, _ := s.mountedOn(ctx, t, "tr", vm, node)
	// The attach/detach controller deletes the VolumeAttachment to detach;
	// the external-attacher's finalizer keeps it until the detach succeeds.
	vas := s.guest.Kube.StorageV1().VolumeAttachments()
	name := guest.AttachmentName(vol, driver.Name, node)
	if _, err := vas.Create(ctx, &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{"external-attacher/driver-harvesterhci-io"},
			Annotations: map[string]string{guest.AttachedNodeIDAnnotation: vm}},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &vol}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = vas.Patch(context.Background(), name, types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
	})
	if err := vas.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	va, err := vas.Get(ctx, name, metav1.GetOptions{})
	if err != nil || va.DeletionTimestamp == nil {
		t.Fatalf("the deleted VolumeAttachment: %v, %v", va, err)
	}
	s.waitGuestCacheAttachment(t, name)
	if err := s.unpublishOnce(ctx, vm, vol); status.Code(err) != codes.Aborted {
		t.Fatalf("unpublish within the timeout = %v, want Aborted", err)
	}
	s.requireReady(vm, vol)
	until := va.DeletionTimestamp.Add(timeout)
	testwait.For(t, "the timeout to pass since the deletion", time.Minute, func() bool { return time.Now().After(until) })
	restart()
	if err := s.unpublishOnce(ctx, vm, vol); err != nil {
		t.Fatalf("first unpublish of a controller started after the deletion plus the timeout = %v, want the unplug to go ahead", err)
	}
	if got := s.attachedTo(vol, vm); len(got) != 0 {
		t.Errorf("%s still on %v after the forced unpublish", vol, got)
	}
	forced := s.guest.WaitNodeEvents(t, node, "VolumeDetachForced")
	if len(forced) != 1 || !strings.Contains(forced[0].Message, vol) {
		t.Errorf("want one VolumeDetachForced naming %s on %s, got %+v", vol, node, forced)
	}
}

// waitGuestCacheAttachment returns once the controller's guest cache shows
// the VolumeAttachment of that name being deleted.
func (s *guestSuite) waitGuestCacheAttachment(t *testing.T, name string) {
	t.Helper()
	nodes := s.ctrl.Driver.GuestNodes()
	testwait.For(t, "the controller's guest cache to show VolumeAttachment "+name+" being deleted", 30*time.Second, func() bool {
		va, ok := nodes.Attachment(name)
		return ok && va.DeletionTimestamp != nil
	})
}

func (s *guestSuite) forced(t *testing.T) {
	const timeout = 2 * time.Second
	s.ctrl.Stop()
	s.ctrl = s.host.StartController(t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig(),
		Guest: s.guest.Env.Config, DetachGuardTimeout: timeout})
	vm, node := "fd-vm", "rke2-fd-worker"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vol, _ := s.mountedOn(ctx, t, "fd", vm, node)

	start := time.Now()
	var codesSeen []codes.Code
	// Every 100 ms, as a patient caller: each refusal is a call the guard
	// answers, and the test is about the first one and the forced one.
	testwait.UntilEvery(ctx, t, 100*time.Millisecond, "the unpublish to be forced", func() (bool, string) {
		err := s.unpublishOnce(ctx, vm, vol)
		codesSeen = append(codesSeen, status.Code(err))
		if err != nil && status.Code(err) != codes.Aborted {
			t.Fatalf("unpublish = %v, want Aborted until the timeout", err)
		}
		return err == nil, fmt.Sprintf("answers %v", codesSeen)
	})
	if codesSeen[0] != codes.Aborted {
		t.Errorf("the first unpublish was not refused: %v", codesSeen)
	}
	if waited := time.Since(start); waited < timeout {
		t.Errorf("forced after %s, before the %s timeout", waited, timeout)
	}
	if got := s.attachedTo(vol, vm); len(got) != 0 {
		t.Errorf("%s still on %v after the forced unpublish", vol, got)
	}
	forced := s.guest.WaitNodeEvents(t, node, "VolumeDetachForced")
	if len(forced) != 1 || forced[0].Type != corev1.EventTypeWarning || !strings.Contains(forced[0].Message, vol) || !strings.Contains(forced[0].Message, vm) {
		t.Errorf("want one Warning VolumeDetachForced naming %s and %s on %s, got %+v", vol, vm, node, forced)
	}
}
