package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testmetrics"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/diagnose"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestWedgedVMIsNoticed: on Harvester 1.8's KubeVirt (declarative v1.7.0),
// the VM's attachment pod never starts, so KubeVirt's entry of a published
// volume stops moving. Once the wedge bound has passed, the publish's answer
// says the VM is wedged (still DeadlineExceeded, which the attacher
// retries), the guest VolumeAttachment carries one HotplugWedged Warning
// across the retries, the gauge counts it and diagnose names it with the
// Pending pod as its cause. When the pod starts, the attach finishes, the
// gauge falls back to zero and a HotplugWedgeCleared Event follows.
func TestWedgedVMIsNoticed(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: scale, BindClasslessPVCs: true})
	g := framework.StartGuest(t)
	qcfg := queueConfig()
	qcfg.WedgedAfter = 2 * time.Second
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: kvbackend.BackendAuto, Queue: qcfg, Guest: g.Env.Config})
	vm, node := "wedge-vm", "rke2-wedge"
	h.CreateVMs(t, vm)
	vol := h.CreateVolumes(t, "wedge", 1)[0]
	g.AddNode(t, node, vm)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	vaName := guest.AttachmentName(vol, driver.Name, node)
	if _, err := g.Kube.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: vaName},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &vol}}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, vm, true)
	released := false
	defer func() {
		if !released {
			h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, vm, false)
		}
	}()

	publish := func() error {
		cctx, c := context.WithTimeout(ctx, time.Second)
		defer c()
		_, err := ctrl.Client.ControllerPublishVolume(cctx, publishReq(vm, vol))
		return err
	}
	testwait.Until(ctx, t, "a publish answered wedged", func() (bool, string) {
		err := publish()
		return status.Code(err) == codes.DeadlineExceeded && strings.Contains(err.Error(), "wedged in KubeVirt"), fmt.Sprint(err)
	})
	for range 3 { // the attacher's retries
		if err := publish(); status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), vol) {
			t.Fatalf("retry answered %v, want DeadlineExceeded naming the volume", err)
		}
	}
	// events lists the messages of the Events of reason, one per time the
	// driver recorded it (the recorder folds repeats into one Event with a
	// count).
	events := func(reason string) []string {
		var out []string
		for _, e := range g.ObjectEvents(t, "VolumeAttachment", vaName) {
			for i := int32(0); e.Reason == reason && i < max(e.Count, 1); i++ {
				out = append(out, e.Message)
			}
		}
		return out
	}
	testwait.Until(ctx, t, "a HotplugWedged Event on "+vaName, func() (bool, string) {
		got := events(driver.ReasonHotplugWedged)
		return len(got) > 0, fmt.Sprint(got)
	})
	if got := events(driver.ReasonHotplugWedged); len(got) != 1 || !strings.Contains(got[0], vol) || !strings.Contains(got[0], hotplug.WedgePlug) {
		t.Errorf("wedge Events %q, want one naming the volume and the step", got)
	}
	if n := wedgedGauge(t, ctrl, hotplug.WedgePlug); n != 1 {
		t.Errorf("harvester_csi_hotplug_wedged_intents{reason=%q} = %v while wedged, want 1", hotplug.WedgePlug, n)
	}
	hc, err := host.NewForConfig(h.ClientConfig(), h.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	in, err := diagnose.Gather(ctx, diagnose.Sources{Host: hc, Driver: driver.Name})
	if err != nil {
		t.Fatal(err)
	}
	in.Queue = ctrl.Queue.State()
	var finding string
	for _, f := range diagnose.Check(in) {
		if f.Kind == diagnose.WedgedVM && f.Volume == vol && f.VM == vm {
			finding = f.Detail
		}
	}
	if !strings.Contains(finding, "attachment pod Pending") {
		t.Errorf("diagnose says %q of the wedge, want the Pending attachment pod as its cause", finding)
	}

	h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, vm, false)
	released = true
	a := newAttacher(func() csiClient { return ctrl.Client })
	if err := a.publish(ctx, vm, vol); err != nil {
		t.Fatalf("publish once the pod may start: %v", err)
	}
	testwait.Until(ctx, t, "the gauge back at zero", func() (bool, string) {
		n := wedgedGauge(t, ctrl, hotplug.WedgePlug)
		return n == 0, fmt.Sprint(n)
	})
	testwait.Until(ctx, t, "a HotplugWedgeCleared Event on "+vaName, func() (bool, string) {
		got := events(driver.ReasonHotplugWedgeCleared)
		return len(got) > 0, fmt.Sprint(got)
	})
}

func wedgedGauge(t *testing.T, ctrl *framework.Controller, reason string) float64 {
	t.Helper()
	if v, ok := testmetrics.Value(t, ctrl.Metrics, "harvester_csi_hotplug_wedged_intents", map[string]string{"reason": reason}); ok {
		return v
	}
	return -1
}
