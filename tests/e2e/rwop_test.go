package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestReadWriteOncePodClaim runs a ReadWriteOncePod claim through a real guest
// control plane (the lab's: real kube-apiserver, controller-manager,
// scheduler, csi-provisioner and csi-attacher with the chart's flags, a real
// kubelet as a hollow node, the driver's controller and node processes): the
// first pod gets the volume and runs; a second pod of the same claim is
// refused by Kubernetes (the scheduler's VolumeRestrictions plugin) and stays
// Pending while the first runs. The sidecars sent the claim to the driver as
// SINGLE_NODE_SINGLE_WRITER, which they do only for a driver that offers
// SINGLE_NODE_MULTI_WRITER (CSI spec v1.5.0); without it ReadWriteOncePod
// arrives as SINGLE_NODE_WRITER, indistinguishable from ReadWriteOnce.
// Follows internal/simguest TestPodWithVolumeRunsAndDetaches.
func TestReadWriteOncePodClaim(t *testing.T) {
	ctx, cancel := context.WithTimeout(klog.NewContext(context.Background(), klog.Background()), 6*time.Minute)
	defer cancel()
	// Verbosity 5: the sidecars log each CSI request they send.
	c := framework.StartCluster(ctx, t, framework.ClusterOptions{
		Sim:   kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.1},
		Nodes: []string{"node-0"}, Verbosity: 5,
	})
	g := c.Guest

	ns, claim := "default", "single"
	c.CreateClaim(ctx, t, ns, claim, corev1.ReadWriteOncePod)
	c.CreatePod(ctx, t, ns, "first", claim, 3600)
	testwait.Until(ctx, t, "the first pod running with the volume", func() (bool, string) {
		if err := g.Procs.Dead(); err != nil {
			t.Fatal(err)
		}
		p, err := g.Kube.CoreV1().Pods(ns).Get(ctx, "first", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return p.Status.Phase == corev1.PodRunning, fmt.Sprintf("pod %s on %q", p.Status.Phase, p.Spec.NodeName)
	})

	c.CreatePod(ctx, t, ns, "second", claim, 3600)
	testwait.Until(ctx, t, "the second pod refused by the scheduler for the ReadWriteOncePod claim", func() (bool, string) {
		p, err := g.Kube.CoreV1().Pods(ns).Get(ctx, "second", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		if p.Spec.NodeName != "" {
			t.Fatalf("the second pod of a ReadWriteOncePod claim was scheduled to %s", p.Spec.NodeName)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
				return strings.Contains(c.Message, "ReadWriteOncePod"), c.Message
			}
		}
		return false, fmt.Sprintf("conditions %v", p.Status.Conditions)
	})
	first, err := g.Kube.CoreV1().Pods(ns).Get(ctx, "first", metav1.GetOptions{})
	if err != nil || first.Status.Phase != corev1.PodRunning {
		t.Fatalf("the first pod no longer runs: %v %v", first.Status.Phase, err)
	}

	// What the driver was asked for: the sidecars log every request at
	// verbosity 5 (csi-lib-utils, "GRPC request").
	for _, sidecar := range []string{"csi-provisioner", "csi-attacher"} {
		data, err := os.ReadFile(g.Procs.LogPath(sidecar))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(data), "SINGLE_NODE_SINGLE_WRITER") && !strings.Contains(string(data), `"mode":6`) {
			t.Errorf("%s never asked for SINGLE_NODE_SINGLE_WRITER; its log:\n%s", sidecar, framework.Tail(string(data), 60))
		}
	}
}
