package testenv

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

func TestStartServesTheAPI(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	env, err := Start(ctx, Options{Namespace: "guests"})
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop()
	kube := kubernetes.NewForConfigOrDie(env.Config)
	if _, err := kube.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Fatalf("get default namespace: %v", err)
	}
	// The kubeconfig file reaches the same server with the same rights and
	// carries the namespace, as a host kubeconfig does.
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(&clientcmd.ClientConfigLoadingRules{ExplicitPath: env.Kubeconfig}, nil)
	ns, _, err := loader.Namespace()
	if err != nil || ns != "guests" {
		t.Fatalf("kubeconfig namespace = %q, %v; want guests", ns, err)
	}
	cfg, err := loader.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kubernetes.NewForConfigOrDie(cfg).CoreV1().Namespaces().Create(ctx, nsObj("guests"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace through the kubeconfig: %v", err)
	}
}

func nsObj(name string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
}
