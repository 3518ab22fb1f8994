package simguest_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// A pod with a claim of the chart's StorageClass runs to completion on a
// guest node through the real provisioner, attach/detach controller,
// external-attacher, kubelet and the driver's processes, and its volume
// detaches afterwards.
func TestPodWithVolumeRunsAndDetaches(t *testing.T) {
	ctx, cancel := context.WithTimeout(klog.NewContext(context.Background(), klog.Background()), 6*time.Minute)
	defer cancel()
	c := framework.StartCluster(ctx, t, framework.ClusterOptions{
		Sim:   kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Version: kubevirtsim.V1_5_3, Scale: 0.1},
		Nodes: []string{"node-0"},
	})
	g := c.Guest

	ns := "default"
	c.CreateClaim(ctx, t, ns, "data", corev1.ReadWriteOnce)
	c.CreatePod(ctx, t, ns, "once", "data", 2)
	var last string
	err := wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		if err := g.Procs.Dead(); err != nil {
			return false, err
		}
		p, err := g.Kube.CoreV1().Pods(ns).Get(ctx, "once", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		vas, _ := g.Kube.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		last = fmt.Sprintf("pod %s on %q, %d VolumeAttachments", p.Status.Phase, p.Spec.NodeName, len(vas.Items))
		return p.Status.Phase == corev1.PodSucceeded, nil
	})
	if err != nil {
		t.Fatalf("pod did not complete (%s): %v", last, err)
	}
	// The attach/detach controller detaches once the kubelet has unmounted.
	err = wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		vas, err := g.Kube.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		node, err := g.Kube.CoreV1().Nodes().Get(ctx, "node-0", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		last = fmt.Sprintf("%d VolumeAttachments, volumesInUse %v", len(vas.Items), node.Status.VolumesInUse)
		return len(vas.Items) == 0 && len(node.Status.VolumesInUse) == 0, nil
	})
	if err != nil {
		t.Fatalf("volume not detached (%s): %v", last, err)
	}
	// The kubelet's CSI plugin drove the node plugin through the whole
	// volume manager order.
	data, err := os.ReadFile(g.Procs.LogPath("driver-node-node-0"))
	if err != nil {
		t.Fatal(err)
	}
	log, at := string(data), 0
	for _, m := range []string{"NodeStageVolume", "NodePublishVolume", "NodeUnpublishVolume", "NodeUnstageVolume"} {
		i := strings.Index(log[at:], `"call done" method="/csi.v1.Node/`+m+`"`)
		if i < 0 {
			t.Fatalf("the node plugin did not complete %s after the previous step; log:\n%s", m, log)
		}
		at += i
	}
}
