module kvfleet.dev/hack/cluster/pause

go 1.26.0
