package integration

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testmetrics"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// cluster is one guest cluster of the shared host namespace: its API
// server, its controller, its VMs (one guest Node each) and its volumes.
type cluster struct {
	name  string
	guest *framework.Guest
	ctrl  *framework.Controller
	vms   []string
	vols  []string
}

func (c *cluster) node(vm string) string { return "node-" + vm }

func (c *cluster) client() csi.ControllerClient { return c.ctrl.Client }

// attach does what the attach/detach controller and the external-attacher
// do, in their order: the VolumeAttachment first, then the publish.
func (c *cluster) attach(ctx context.Context, a *attacher, vm, vol string) error {
	pv := vol
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: guest.AttachmentName(vol, driver.Name, c.node(vm)), Annotations: map[string]string{guest.AttachedNodeIDAnnotation: vm}},
		Spec:       storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: c.node(vm), Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv}},
	}
	if _, err := c.guest.Kube.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{}); err != nil {
		return err
	}
	return a.publish(ctx, vm, vol)
}

// detach unpublishes, then the VolumeAttachment goes.
func (c *cluster) detach(ctx context.Context, a *attacher, vm, vol string) error {
	if err := a.unpublish(ctx, vm, vol); err != nil {
		return err
	}
	return c.deleteVA(ctx, vm, vol)
}

func (c *cluster) deleteVA(ctx context.Context, vm, vol string) error {
	err := c.guest.Kube.StorageV1().VolumeAttachments().Delete(ctx, guest.AttachmentName(vol, driver.Name, c.node(vm)), metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// TestOrphansWithTwoClustersInOneNamespace: two guest clusters put their VMs
// and volumes in one host namespace (harvester/harvester#10906), each with
// its own controller, and churn publishes and unpublishes through them in
// the attacher's order. Cluster A runs the orphan reconciler with a short
// grace period; cluster B runs it off, so that what B leaves orphaned stays
// for A to leave alone. A guest Node of A shares its name with a VM of B
// (with a providerID naming a VM elsewhere). While the churn runs, A's
// orphans of each origin are made: a VolumeAttachment deleted by hand, a
// publish answered after its caller gave up, a guest Node deleted and
// registered again, one the guest still has mounted, and one written by a
// controller that crashed before it answered. Every one of A's
// orphans leaves its VM (the mounted one only once kubelet lets go), every
// volume a VolumeAttachment asks for stays, and B's VMs and volumes are never
// touched.
func TestOrphansWithTwoClustersInOneNamespace(t *testing.T) {
	f := flavor{"declarative-v1.7", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, kvbackend.BackendDeclarative, false}
	h := framework.StartHost(t, kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: scale, BindClasslessPVCs: true})
	s := &suite{t: t, f: f, host: h, kv: kubevirt.NewForConfigOrDie(h.Env.Config)}
	a := &cluster{name: "a", guest: framework.StartGuest(t), vms: []string{"a-vm-1", "a-vm-2"}}
	b := &cluster{name: "b", guest: framework.StartGuest(t), vms: []string{"b-vm-1", "b-vm-2"}}
	for _, c := range []*cluster{a, b} {
		c.vols = s.scene(t, c.name+"v", 8, c.vms...)
		for _, vm := range c.vms {
			c.guest.AddNode(t, c.node(vm), vm)
		}
		c.guest.AddPVs(t, c.vols...)
	}
	// A Node of A named like B's VM, its VM elsewhere, its plugin not
	// registered: B's VM is not A's for that.
	namesake := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "b-vm-1"}, Spec: corev1.NodeSpec{ProviderID: guest.ProviderIDPrefix + "uid-of-a-vm-elsewhere"}}
	if _, err := a.guest.Kube.CoreV1().Nodes().Create(context.Background(), namesake, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	a.guest.SetReady(t, "b-vm-1", corev1.ConditionTrue)
	grace := 2 * time.Second
	a.ctrl = h.StartController(t, framework.ControllerOptions{Backend: f.backendFlag(), Queue: queueConfig(), Guest: a.guest.Env.Config,
		DetachGuardTimeout: time.Hour, NodeMonitor: true, Orphans: true, Orphan: guest.OrphanConfig{Grace: grace, Interval: 200 * time.Millisecond},
		Monitor: guest.MonitorConfig{Identity: "a", LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: 200 * time.Millisecond}})
	b.ctrl = h.StartController(t, framework.ControllerOptions{Backend: f.backendFlag(), Queue: queueConfig(), Guest: b.guest.Env.Config,
		DetachGuardTimeout: time.Hour, NodeMonitor: true,
		Monitor: guest.MonitorConfig{Identity: "b", LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: 200 * time.Millisecond}})
	s.ctrl = a.ctrl
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	testwait.For(t, "cluster A's controller to lead", time.Minute, func() bool { return a.ctrl.Driver.Monitor().Leading() })
	aa, ba := newAttacher(a.client), newAttacher(b.client)

	// B's orphans: published, then their VolumeAttachments gone.
	bOrphans := map[string]string{b.vols[0]: b.vms[0], b.vols[1]: b.vms[1]}
	for vol, vm := range bOrphans {
		if err := b.attach(ctx, ba, vm, vol); err != nil {
			t.Fatal(err)
		}
		if err := b.deleteVA(ctx, vm, vol); err != nil {
			t.Fatal(err)
		}
	}

	// Churn on both clusters' other volumes for as long as A's orphans take.
	churnCtx, stopChurn := context.WithCancel(ctx)
	var wg sync.WaitGroup
	churnErrs := make(chan error, 16)
	for _, c := range []*cluster{a, b} {
		at := newAttacher(c.client)
		for i, vol := range c.vols[5:] {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(i), 7))
				for churnCtx.Err() == nil {
					vm := c.vms[rng.IntN(len(c.vms))]
					if err := c.attach(churnCtx, at, vm, vol); err != nil {
						if churnCtx.Err() == nil {
							churnErrs <- fmt.Errorf("cluster %s: attach %s to %s: %w", c.name, vol, vm, err)
						}
						return
					}
					// Held well past the grace period: a wanted volume must stay.
					s.expectAttached(churnCtx, t, vol, vm, 2*grace)
					if err := c.detach(context.WithoutCancel(churnCtx), at, vm, vol); err != nil {
						churnErrs <- fmt.Errorf("cluster %s: detach %s from %s: %w", c.name, vol, vm, err)
						return
					}
				}
			}()
		}
	}

	// A's orphans, one per origin.
	byHand, gaveUp, nodeGone, mounted := a.vols[0], a.vols[1], a.vols[2], a.vols[3]
	vm1, vm2 := a.vms[0], a.vms[1]
	if err := a.attach(ctx, aa, vm1, byHand); err != nil {
		t.Fatal(err)
	}
	if err := a.deleteVA(ctx, vm1, byHand); err != nil { // deleted by hand, finalizer and all
		t.Fatal(err)
	}
	// A publish whose caller gives up before KubeVirt is done: no
	// VolumeAttachment ever asks for it (the attacher's was deleted).
	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err := a.ctrl.Client.ControllerPublishVolume(short, publishReq(vm1, gaveUp))
	cancelShort()
	t.Logf("publish of %s answered %v before KubeVirt was done", gaveUp, err)
	testwait.For(t, gaveUp+" to reach "+vm1+" after its caller gave up", time.Minute, func() bool { return len(s.attachedTo(gaveUp, vm1)) > 0 })
	// The guest Node is deleted with its VolumeAttachment, then kubelet
	// registers it again.
	if err := a.attach(ctx, aa, vm2, nodeGone); err != nil {
		t.Fatal(err)
	}
	if err := a.deleteVA(ctx, vm2, nodeGone); err != nil {
		t.Fatal(err)
	}
	if err := a.guest.Kube.CoreV1().Nodes().Delete(ctx, a.node(vm2), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := a.guest.Kube.StorageV1().CSINodes().Delete(ctx, a.node(vm2), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// A forced detach while kubelet still has the volume mounted.
	if err := a.attach(ctx, aa, vm1, mounted); err != nil {
		t.Fatal(err)
	}
	a.guest.SetMounted(t, a.node(vm1), mounted)
	if err := a.deleteVA(ctx, vm1, mounted); err != nil {
		t.Fatal(err)
	}

	for _, vol := range []string{byHand, gaveUp} {
		testwait.For(t, "orphan "+vol+" to leave cluster A's VM", time.Minute, func() bool { return len(s.attachedTo(vol, a.vms...)) == 0 })
	}
	if got := s.attachedTo(nodeGone, vm2); len(got) == 0 {
		t.Errorf("%s left %s while no guest Node of cluster A ran on it", nodeGone, vm2)
	}
	a.guest.AddNode(t, a.node(vm2), vm2)
	testwait.For(t, "orphan "+nodeGone+" to leave once its Node is back", time.Minute, func() bool { return len(s.attachedTo(nodeGone, vm2)) == 0 })
	if got := s.attachedTo(mounted, vm1); len(got) == 0 {
		t.Errorf("%s left %s while its guest Node still had it mounted", mounted, vm1)
	}
	a.guest.SetMounted(t, a.node(vm1))
	testwait.For(t, "orphan "+mounted+" to leave once kubelet let go", time.Minute, func() bool { return len(s.attachedTo(mounted, vm1)) == 0 })

	stopChurn()
	wg.Wait()
	close(churnErrs)
	for err := range churnErrs {
		t.Error(err)
	}
	for vol, vm := range bOrphans {
		if got := s.attachedTo(vol, vm); len(got) == 0 {
			t.Errorf("cluster B's volume %s left its VM %s: cluster A touched it", vol, vm)
		}
	}
	if got := counterValue(t, a.ctrl, "harvester_csi_hotplug_orphans_removed_total"); got != 4 {
		t.Errorf("cluster A removed %v orphans, want 4", got)
	}
	if ev := a.guest.WaitNodeEvents(t, a.node(vm1), "OrphanedVolumeRemoved"); len(ev) == 0 {
		t.Error("no OrphanedVolumeRemoved Event on the guest Node")
	}

	// A crash between the write and the answer: the controller stops once
	// the volume is in the VM spec, before KubeVirt is done and before it
	// answered; its VolumeAttachment is gone by the time a new controller
	// leads, which finds the volume and removes it.
	crashed := a.vols[4]
	published := make(chan error, 1)
	go func() {
		_, err := a.ctrl.Client.ControllerPublishVolume(ctx, publishReq(vm2, crashed))
		published <- err
	}()
	testwait.For(t, crashed+" written into "+vm2, time.Minute, func() bool { return len(s.attachedTo(crashed, vm2)) > 0 })
	a.ctrl.Stop()
	t.Logf("publish cut off by the crash answered %v", <-published)
	a.ctrl = h.StartController(t, framework.ControllerOptions{Backend: f.backendFlag(), Queue: queueConfig(), Guest: a.guest.Env.Config,
		DetachGuardTimeout: time.Hour, NodeMonitor: true, Orphans: true, Orphan: guest.OrphanConfig{Grace: grace, Interval: 200 * time.Millisecond},
		Monitor: guest.MonitorConfig{Identity: "a-restarted", LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: 200 * time.Millisecond}})
	testwait.For(t, "orphan "+crashed+" to leave after the crash", time.Minute, func() bool { return len(s.attachedTo(crashed, vm2)) == 0 })
	for vol, vm := range bOrphans {
		if got := s.attachedTo(vol, vm); len(got) == 0 {
			t.Errorf("cluster B's volume %s left its VM %s after cluster A's controller restarted", vol, vm)
		}
	}
}

// errLeft ends a hold in which the volume left its VM.
var errLeft = errors.New("the volume left its VM")

// expectAttached fails the test if vol leaves vm within d (or until ctx
// ends): a volume a VolumeAttachment asks for must stay.
func (s *suite) expectAttached(ctx context.Context, t *testing.T, vol, vm string, d time.Duration) {
	hold, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	err := testwait.PollEvery(hold, 100*time.Millisecond, vol+" held on "+vm, func() (bool, string, error) {
		if len(s.attachedTo(vol, vm)) == 0 {
			return false, "", errLeft
		}
		return false, "attached", nil
	})
	if errors.Is(err, errLeft) {
		t.Errorf("%s left %s while its VolumeAttachment asked for it", vol, vm)
	}
}

// counterValue reads a counter the controller registered.
func counterValue(t *testing.T, c *framework.Controller, name string) float64 {
	t.Helper()
	v, ok := testmetrics.Value(t, c.Metrics, name, nil)
	if !ok {
		t.Fatalf("no metric %s registered", name)
	}
	return v
}
